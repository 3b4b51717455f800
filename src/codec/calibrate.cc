// alpha = auto: choose the LYNX alpha-law parameter from the data
// (docs/FORMAT.md section 2.6).  Uses the codec's own normalisation,
// codebooks and reconstruction, in fp32, on a deterministic chunk sample.
#include <algorithm>
#include <cinttypes>

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
  for (int32_t p = 0; p < num_pages; ++p) {
    Layout lay;
    KVXFER_CHECK(validate_layout(&pages[p], "calibration page", &lay));
    const int64_t T = pages[p].num_tokens;
    const int32_t H = pages[p].num_channels;
    const auto dt = pages[p].dtype;
    const int64_t chunks = (T + C - 1) / C;
    const int64_t samples = std::min<int64_t>(chunks, kCalibrationChunksPerPage);
    // The sample: every finite chunk-channel of up to 8 evenly spaced chunks,
    // with the affine map the encoder would store for it.
    std::vector<float> xs;
    std::vector<Affine> as;
    std::vector<float> x(static_cast<size_t>(C));
    for (int64_t s = 0; s < samples; ++s) {
      const int64_t k = s * chunks / samples;  // evenly spaced, deterministic
      const int64_t t0 = k * C, t1 = std::min<int64_t>(T, t0 + C);
      for (int32_t c = 0; c < H; ++c) {
        bool finite = true;
        float mn = load_elem(lay.row(t0), c, dt), mx = mn;
        for (int64_t t = t0; t < t1; ++t) {
          const float v = load_elem(lay.row(t), c, dt);
          x[t - t0] = v;
          finite &= std::isfinite(v);
          if (v < mn) mn = v;
          if (v > mx) mx = v;
        }
        if (!finite) continue;
        canonical_minmax(&mn, &mx);
        Affine a{0.0f, 0.0f};
        if (!chunk_affine(mn, mx, false, &a)) chunk_affine(mn, mx, true, &a);
        xs.insert(xs.end(), x.begin(), x.begin() + (t1 - t0));
        as.insert(as.end(), static_cast<size_t>(t1 - t0), a);
      }
    }
    // Each candidate: codes, this page's anchor table (as the encoder builds
    // it, from the code histogram), then the squared errors.
    std::vector<uint8_t> codes(xs.size());
    for (int i = 0; i < ncand; ++i) {
      const Codebook& cb = *cbs[i];
      uint64_t hist[256] = {0};
      for (size_t j = 0; j < xs.size(); ++j)
        ++hist[codes[j] = cb.encode_lut(normalise(xs[j], as[j]))];
      float table[64];
      anchor_table_from_histogram(cb, hist, table);
      for (size_t j = 0; j < xs.size(); ++j) {
        const double ef = static_cast<double>(denormalise(cb.recon_full[codes[j]], as[j])) - xs[j];
        const double ea =
            static_cast<double>(denormalise(table[codes[j] >> cb.residual_bits], as[j])) - xs[j];
        err[i].full += ef * ef;
        err[i].anchor += ea * ea;
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
