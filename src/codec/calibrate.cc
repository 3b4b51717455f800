// alpha = auto: choose the LYNX alpha-law parameter from the data
// (docs/FORMAT.md section 2.6).  Uses the codec's own normalisation,
// codebooks and reconstruction, in fp32, on a deterministic chunk sample.
#include <algorithm>
#include <cinttypes>
#include <list>

#include "codec/codec.h"
#include "codec/fast.h"
#include "codec/page.h"
#include "common/error.h"

namespace kvxfer::codec {

kvxfer_result_t calibrate_alpha(const kvxfer_codec_config_t* cfg, const kvxfer_page_layout_t* pages,
                                int32_t num_pages, float* alpha,
                                std::vector<CalibrationError>* errors) {
  KVXFER_REQUIRE(cfg != nullptr && alpha != nullptr, "NULL config or output");
  KVXFER_REQUIRE(cfg->codec == KVXFER_CODEC_LYNX, "alpha calibration needs the LYNX codec");
  KVXFER_REQUIRE(pages != nullptr && num_pages >= 1, "need at least one calibration page");
  KVXFER_REQUIRE(valid_chunk_tokens(cfg->chunk_tokens), "chunk_tokens %d is not 16, 32, 64 or 128",
                 cfg->chunk_tokens);
  const int ncand = static_cast<int>(sizeof(kAlphaCandidates) / sizeof(kAlphaCandidates[0]));
  std::vector<CodebookRef> cbs;
  for (float a : kAlphaCandidates) {
    std::string why;
    const CodebookRef cb = get_codebook(KVXFER_CODEC_LYNX, a, cfg->anchor_bits, &why);
    if (cb == nullptr)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT, "calibration: %s", why.c_str());
    cbs.push_back(cb);
  }
  std::vector<CalibrationError> err(ncand);
  for (int i = 0; i < ncand; ++i) err[i] = {kAlphaCandidates[i], 0.0, 0.0};

  const int C = cfg->chunk_tokens;
  // Kernels give identical results on every path: the choice does not
  // depend on the CPU.
  const fast::RowKernels& K = fast::cpu_has_avx2() ? fast::avx2_kernels() : fast::scalar_kernels();
  for (int32_t p = 0; p < num_pages; ++p) {
    Layout lay;
    KVXFER_CHECK(validate_layout(&pages[p], "calibration page", &lay));
    const int64_t T = pages[p].num_tokens;
    const int32_t H = pages[p].num_channels;
    const auto dt = pages[p].dtype;
    const int64_t chunks = (T + C - 1) / C;
    const int64_t samples = std::min<int64_t>(chunks, kCalibrationChunksPerPage);
    // The sample: the rows hist_row() picks (the rows of the anchor table's
    // histogram) of up to 8 evenly spaced chunks, every channel whose chunk
    // is finite, with the affine map the encoder would store for it.
    std::vector<const uint8_t*> rows(static_cast<size_t>(C));
    std::vector<float> mn(H), mx(H), sc(H);
    // Per candidate: codes of every sampled row (row-major), then errors.
    struct SampleRow {
      const uint8_t* row;
      int64_t k;
    };
    std::vector<SampleRow> srows;
    std::list<std::vector<uint8_t>> clean;  // finite copies of rows with NaN/Inf (stable addresses)
    std::vector<float> sm, sd;              // [sampled chunk][channel]
    std::vector<uint8_t> sok;
    for (int64_t si = 0; si < samples; ++si) {
      const int64_t k = si * chunks / samples;  // evenly spaced, deterministic
      const int64_t t0 = k * C, t1 = std::min<int64_t>(T, t0 + C);
      const int n = static_cast<int>(t1 - t0);
      for (int r = 0; r < n; ++r) rows[r] = lay.row(t0 + r);
      bool finite = K.chunk_minmax(rows.data(), n, dt, H, mn.data(), mx.data());
      for (int32_t c = 0; c < H; ++c) {
        bool cf = true;
        if (!finite) {  // find the finite channels one by one
          for (int r = 0; r < n && cf; ++r) cf = !f32_nonfinite(load_elem(rows[r], c, dt));
        }
        Affine a{0.0f, 0.0f};
        if (cf) {
          canonical_minmax(&mn[c], &mx[c]);
          if (!chunk_affine(mn[c], mx[c], false, &a)) chunk_affine(mn[c], mx[c], true, &a);
        }
        sm.push_back(a.m);
        sd.push_back(a.d);
        sok.push_back(cf ? 1 : 0);
      }
      for (int64_t t = t0; t < t1; ++t) {
        if (!hist_row(t, 0)) continue;
        const uint8_t* row = lay.row(t);
        if (!finite) {
          // The channels left out (sok 0) still go through encode_row, whose
          // code lookup needs a finite z: their NaN/Inf become +0 in a copy.
          const size_t es = dtype_size(dt);
          clean.emplace_back(row, row + es * static_cast<size_t>(H));
          for (int32_t c = 0; c < H; ++c)
            if (f32_nonfinite(load_elem(row, c, dt)))
              std::fill_n(clean.back().begin() + es * static_cast<size_t>(c), es, uint8_t{0});
          row = clean.back().data();
        }
        srows.push_back({row, static_cast<int64_t>(sm.size() / H - 1)});
      }
    }
    // Each candidate: codes, this page's anchor values (the table as the
    // encoder builds it, from the code histogram of the same rows, or the
    // codebook's fixed anchor levels), then the squared errors.
    std::vector<uint8_t> codes(srows.size() * static_cast<size_t>(H));
    for (int i = 0; i < ncand; ++i) {
      const Codebook& cb = *cbs[i];
      uint64_t hist[256] = {0};
      for (size_t r = 0; r < srows.size(); ++r) {
        const size_t base = static_cast<size_t>(srows[r].k) * H;
        for (int32_t c = 0; c < H; ++c) sc[c] = cb.scale(sd[base + c]);
        uint8_t* out = codes.data() + r * H;
        K.encode_row(srows[r].row, dt, H, sm.data() + base, sc.data(), cb, out);
        for (int32_t c = 0; c < H; ++c)
          if (sok[base + c]) ++hist[out[c]];
      }
      float table[64];
      if (has_anchor_table(cb))
        anchor_table_from_histogram(cb, hist, table);
      else
        std::copy(cb.recon_anchor, cb.recon_anchor + 64, table);
      double accf[8] = {0}, acca[8] = {0};  // lane c % 8, each in row order
      for (size_t r = 0; r < srows.size(); ++r) {
        const size_t base = static_cast<size_t>(srows[r].k) * H;
        K.row_sq_errors(srows[r].row, dt, H, codes.data() + r * H, sm.data() + base,
                        sd.data() + base, sok.data() + base, cb.recon_full, table,
                        static_cast<unsigned>(cb.residual_bits), accf, acca);
      }
      for (int l = 0; l < 8; ++l) {
        err[i].full += accf[l];
        err[i].anchor += acca[l];
      }
    }
  }
  // argmin E_anchor subject to E_full <= E_full(alpha = 0); candidates are
  // ascending, so strict '<' keeps the smaller alpha on ties.
  int best = 0;
  for (int i = 1; i < ncand; ++i)
    if (err[i].full <= err[0].full && err[i].anchor < err[best].anchor) best = i;
  *alpha = kAlphaCandidates[best];
  if (errors != nullptr) *errors = err;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::codec
