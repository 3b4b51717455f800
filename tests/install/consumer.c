/*
 * Uses an installed libkvxfer through <kvxfer/kvxfer.h> only, in C: version
 * check, then page encode/decode round trips compared byte for byte.
 * Exit status 0 = every check passed; each failure is printed.
 */
#include <kvxfer/kvxfer.h>
#include <kvxfer/version.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "consumer.c:%d: check failed: %s (last error: '%s')\n", __LINE__, #cond, \
              kvxfer_get_last_error());                                                        \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)

enum { T = 64, H = 32, BLOCK = 16 };

/* A page of T tokens x H channels in T/BLOCK blocks, contiguous rows. */
typedef struct {
  void* blocks[T / BLOCK];
  kvxfer_page_layout_t layout;
} page_t;

static void page_init(page_t* p, void* storage, kvxfer_dtype_t dtype, size_t elem_size) {
  int b;
  for (b = 0; b < T / BLOCK; ++b) p->blocks[b] = (char*)storage + (size_t)b * BLOCK * H * elem_size;
  memset(&p->layout, 0, sizeof(p->layout));
  p->layout.blocks = p->blocks;
  p->layout.num_blocks = T / BLOCK;
  p->layout.block_size = BLOCK;
  p->layout.row_stride = H;
  p->layout.first_token = 0;
  p->layout.num_tokens = T;
  p->layout.num_channels = H;
  p->layout.dtype = dtype;
}

/* Deterministic KV-like value for (token, channel). */
static float value_at(int t, int c) {
  return (float)(sin(0.37 * t + 1.3 * c) * (1.0 + (c % 5)) + 0.01 * c);
}

static unsigned char anchor[1 << 16], residual[1 << 16];

int main(void) {
  int version = 0;
  size_t anchor_max = 0, residual_max = 0, anchor_len = 0, residual_len = 0;
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  kvxfer_page_id_t id = {3, KVXFER_KV_VALUE, 128, 77};
  kvxfer_page_info_t info;
  static float src32[T * H], out32[T * H], anchor32[T * H], again32[T * H];
  static unsigned short src16[T * H], out16[T * H];
  page_t src, out;
  double err_anchor = 0, err_full = 0;
  int i;

  /* Version: library and header agree. */
  CHECK(kvxfer_get_version(&version) == KVXFER_SUCCESS);
  CHECK(version == KVXFER_VERSION_CODE);
  CHECK(KVXFER_VERSION_CODE == KVXFER_MAJOR * 10000 + KVXFER_MINOR * 100 + KVXFER_PATCH);
  printf("kvxfer version %d (header %d.%d.%d)\n", version, KVXFER_MAJOR, KVXFER_MINOR,
         KVXFER_PATCH);

  /* 1. BF16 passthrough of BF16 input: the decoded page equals the input byte for byte. */
  for (i = 0; i < T * H; ++i) {
    float f = value_at(i / H, i % H);
    unsigned int u;
    memcpy(&u, &f, sizeof(u));
    src16[i] = (unsigned short)(u >> 16); /* truncation gives a valid bf16 */
  }
  memset(out16, 0xA5, sizeof(out16));
  cfg.codec = KVXFER_CODEC_BF16;
  page_init(&src, src16, KVXFER_DTYPE_BF16, 2);
  page_init(&out, out16, KVXFER_DTYPE_BF16, 2);
  CHECK(kvxfer_page_max_size(&cfg, T, H, &anchor_max, &residual_max) == KVXFER_SUCCESS);
  CHECK(anchor_max <= sizeof(anchor) && residual_max <= sizeof(residual));
  CHECK(kvxfer_page_encode(&cfg, &id, &src.layout, anchor, sizeof(anchor), &anchor_len, residual,
                           sizeof(residual), &residual_len) == KVXFER_SUCCESS);
  CHECK(anchor_len > 0 && anchor_len <= anchor_max && residual_len <= residual_max);
  CHECK(kvxfer_page_decode(anchor, anchor_len, residual_len ? residual : NULL, residual_len, &id,
                           &out.layout) == KVXFER_SUCCESS);
  CHECK(memcmp(src16, out16, sizeof(src16)) == 0);

  /* 2. LYNX (default config) on fp32: anchor-only and full decodes; full is closer. */
  cfg.codec = KVXFER_CODEC_LYNX;
  for (i = 0; i < T * H; ++i) src32[i] = value_at(i / H, i % H);
  page_init(&src, src32, KVXFER_DTYPE_FP32, 4);
  CHECK(kvxfer_page_encode(&cfg, &id, &src.layout, anchor, sizeof(anchor), &anchor_len, residual,
                           sizeof(residual), &residual_len) == KVXFER_SUCCESS);
  CHECK(anchor_len > 0 && residual_len > 0);
  CHECK(kvxfer_page_inspect(anchor, anchor_len, &info) == KVXFER_SUCCESS);
  CHECK(info.is_residual == 0 && info.codec == KVXFER_CODEC_LYNX && info.num_tokens == T &&
        info.num_channels == H && info.id.layer == 3 && info.id.kind == KVXFER_KV_VALUE &&
        info.id.token_begin == 128 && info.id.stream_id == 77 && info.section_bytes == anchor_len);
  CHECK(kvxfer_page_inspect(residual, residual_len, &info) == KVXFER_SUCCESS);
  CHECK(info.is_residual == 1 && info.section_bytes == residual_len);

  page_init(&out, anchor32, KVXFER_DTYPE_FP32, 4);
  CHECK(kvxfer_page_decode(anchor, anchor_len, NULL, 0, &id, &out.layout) == KVXFER_SUCCESS);
  page_init(&out, out32, KVXFER_DTYPE_FP32, 4);
  CHECK(kvxfer_page_decode(anchor, anchor_len, residual, residual_len, &id, &out.layout) ==
        KVXFER_SUCCESS);
  page_init(&out, again32, KVXFER_DTYPE_FP32, 4);
  CHECK(kvxfer_page_decode(anchor, anchor_len, residual, residual_len, NULL, &out.layout) ==
        KVXFER_SUCCESS);
  CHECK(memcmp(out32, again32, sizeof(out32)) == 0); /* decoding is deterministic */
  for (i = 0; i < T * H; ++i) {
    CHECK(isfinite(out32[i]) && isfinite(anchor32[i]));
    err_anchor += (anchor32[i] - src32[i]) * (double)(anchor32[i] - src32[i]);
    err_full += (out32[i] - src32[i]) * (double)(out32[i] - src32[i]);
  }
  printf(
      "LYNX: anchor %zu B + residual %zu B for %zu B of fp32; squared error anchor %.4g, full "
      "%.4g\n",
      anchor_len, residual_len, sizeof(src32), err_anchor, err_full);
  CHECK(err_full < err_anchor);
  CHECK(err_full < 1e-3 * T * H);

  /* 3. Raw fallback: a NaN page is stored losslessly, so it decodes byte for byte. */
  src32[5 * H + 7] = NAN;
  cfg.nonfinite = KVXFER_NONFINITE_ERROR;
  CHECK(kvxfer_page_encode(&cfg, &id, &src.layout, anchor, sizeof(anchor), &anchor_len, residual,
                           sizeof(residual), &residual_len) == KVXFER_ERR_NONFINITE);
  CHECK(strlen(kvxfer_get_last_error()) > 0);
  cfg.nonfinite = KVXFER_NONFINITE_RAW;
  CHECK(kvxfer_page_encode(&cfg, &id, &src.layout, anchor, sizeof(anchor), &anchor_len, residual,
                           sizeof(residual), &residual_len) == KVXFER_SUCCESS);
  page_init(&out, out32, KVXFER_DTYPE_FP32, 4);
  CHECK(kvxfer_page_decode(anchor, anchor_len, residual_len ? residual : NULL, residual_len, &id,
                           &out.layout) == KVXFER_SUCCESS);
  CHECK(memcmp(src32, out32, sizeof(src32)) == 0);

  /* 4. Errors come back as negative codes with text. */
  CHECK(kvxfer_page_decode(anchor, anchor_len / 2, NULL, 0, &id, &out.layout) < 0);
  CHECK(strlen(kvxfer_get_last_error()) > 0);
  CHECK(strlen(kvxfer_get_error_string(KVXFER_ERR_CORRUPT)) > 0);
  CHECK(kvxfer_get_version(NULL) == KVXFER_ERR_INVALID_ARGUMENT);

  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("consumer: all checks passed\n");
  return 0;
}
