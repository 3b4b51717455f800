/*
 * kv_transfer: the smallest complete use of kvxfer_send / kvxfer_recv.
 *
 * One process makes the unique id, forks, and the two processes become the
 * two ranks of a communicator: rank 1 (the "prefill" side) sends a paged bf16
 * KV cache, rank 0 (the "decode" side) receives it into blocks of a different
 * size and prints when the anchors landed (ANCHOR_READY) and when the full
 * precision did (COMPLETE).  Plain C, public header only.
 *
 *   ./build/examples/kv_transfer [tokens]        (default 2048)
 */
#include <kvxfer/kvxfer.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define LAYERS 4
#define KV_HEADS 8
#define HEAD_DIM 128
#define CH (KV_HEADS * HEAD_DIM)

#define CHECK(call)                                                              \
  do {                                                                           \
    kvxfer_result_t r_ = (call);                                                 \
    if (r_ != KVXFER_SUCCESS) {                                                  \
      fprintf(stderr, "%s failed: %s: %s\n", #call, kvxfer_get_error_string(r_), \
              kvxfer_get_last_error());                                          \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

/* A paged KV cache: LAYERS x {K, V} block tables of `block` tokens each. */
typedef struct {
  void** k;
  void** v;
  int64_t num_blocks;
  kvxfer_kv_desc_t desc;
} paged_kv;

static paged_kv make_kv(int64_t tokens, int32_t block) {
  paged_kv p;
  p.num_blocks = (tokens + block - 1) / block;
  p.k = calloc((size_t)(LAYERS * p.num_blocks), sizeof(void*));
  p.v = calloc((size_t)(LAYERS * p.num_blocks), sizeof(void*));
  for (int64_t i = 0; i < LAYERS * p.num_blocks; ++i) {
    p.k[i] = calloc((size_t)block * CH, 2);
    p.v[i] = calloc((size_t)block * CH, 2);
  }
  kvxfer_kv_desc_t d = KVXFER_KV_DESC_INITIALIZER;
  d.num_layers = LAYERS;
  d.kv_heads = KV_HEADS;
  d.head_dim = HEAD_DIM;
  d.dtype = KVXFER_DTYPE_BF16;
  d.num_tokens = tokens;
  d.block_size = block;
  d.row_stride = CH;
  d.num_blocks = p.num_blocks;
  d.k_blocks = p.k;
  d.v_blocks = p.v;
  p.desc = d;
  return p;
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static double ms(int64_t a, int64_t b) { return (double)(b - a) / 1e6; }

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? atoll(argv[1]) : 2048;
  if (tokens < 1 || tokens > (1 << 20)) {
    fprintf(stderr, "usage: %s [tokens], 1 to %d (default 2048)\n", argv[0], 1 << 20);
    return 2;
  }
  kvxfer_unique_id_t id;
  CHECK(kvxfer_get_unique_id(&id)); /* this process will be rank 0 */
  fflush(NULL);
  const pid_t child = fork();
  if (child < 0) return 1;

  if (child == 0) { /* rank 1: the prefill side sends */
    kvxfer_comm_t comm;
    CHECK(kvxfer_comm_init(&comm, 2, id, 1, NULL));
    paged_kv kv = make_kv(tokens, 16);
    for (int64_t i = 0; i < LAYERS * kv.num_blocks; ++i)
      for (int j = 0; j < 16 * CH; ++j) {
        ((uint16_t*)kv.k[i])[j] = to_bf16(sinf(0.01f * (float)(i * 31 + j)));
        ((uint16_t*)kv.v[i])[j] = to_bf16(cosf(0.02f * (float)(i * 17 + j)));
      }
    kvxfer_codec_config_t codec = KVXFER_CODEC_CONFIG_INITIALIZER; /* Lynx 4+4 */
    kvxfer_request_t req;
    CHECK(kvxfer_send(comm, 0, &kv.desc, &codec, NULL, &req));
    CHECK(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1));
    CHECK(kvxfer_request_free(req));
    CHECK(kvxfer_comm_destroy(comm));
    _exit(0);
  }

  /* rank 0: the decode side receives, into blocks of 64 tokens */
  kvxfer_comm_t comm;
  CHECK(kvxfer_comm_init(&comm, 2, id, 0, NULL));
  paged_kv kv = make_kv(tokens, 64);
  kvxfer_request_t req;
  CHECK(kvxfer_recv(comm, 1, &kv.desc, NULL, &req));
  CHECK(kvxfer_wait_layer(req, 0, KVXFER_STAGE_ANCHOR_READY, -1));
  kvxfer_request_info_t first = KVXFER_REQUEST_INFO_INITIALIZER;
  CHECK(kvxfer_request_get_info(req, &first));
  CHECK(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1));
  kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
  CHECK(kvxfer_request_get_info(req, &info));
  printf("received %lld tokens x %d layers (%.1f MiB of bf16 KV) in %lld pages\n",
         (long long)tokens, LAYERS, (double)info.kv_bytes / (1 << 20), (long long)info.num_pages);
  printf("  wire bytes: anchor %llu, residual %llu (%.3f of the bf16 size)\n",
         (unsigned long long)info.anchor_wire_bytes, (unsigned long long)info.residual_wire_bytes,
         (double)(info.anchor_wire_bytes + info.residual_wire_bytes) / (double)info.kv_bytes);
  printf("  handshake     %8.2f ms after posting\n", ms(info.t_posted_ns, info.t_handshake_ns));
  printf("  ANCHOR_READY  %8.2f ms (every page usable at anchor precision)\n",
         ms(info.t_posted_ns, info.t_anchor_ready_ns));
  printf("  COMPLETE      %8.2f ms (full precision, checksums verified)\n",
         ms(info.t_posted_ns, info.t_complete_ns));
  const int64_t t = tokens > 5 ? 5 : tokens - 1; /* a token that was transferred */
  printf("  value [layer 0, K, token %lld, channel 3] = 0x%04x\n", (long long)t,
         ((uint16_t*)kv.k[t / 64])[(t % 64) * CH + 3]);
  CHECK(kvxfer_request_free(req));
  CHECK(kvxfer_comm_destroy(comm));
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
