// Internal C++ entry points of the page codec (the C API in api/codec_api.cc
// wraps these).  All return kvxfer_result_t and never throw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

/** Which CPU path runs the quantizing codecs.  All produce identical bytes. */
enum class Impl { AUTO, REFERENCE, SCALAR, AVX2, AVX512 };

/** Resolves AUTO/AVX2/AVX512 against the CPU and KVXFER_CODEC_IMPL. */
kvxfer_result_t resolve_impl(Impl requested, Impl* out);

kvxfer_result_t validate_config(const kvxfer_codec_config_t* cfg);

kvxfer_result_t max_sizes(const kvxfer_codec_config_t* cfg, int64_t num_tokens,
                          int32_t num_channels, size_t* anchor_bytes, size_t* residual_bytes);

/** threads <= 0: KVXFER_CODEC_THREADS (0 there = one per core). */
kvxfer_result_t encode_page(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                            const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                            size_t* anchor_len, void* residual, size_t residual_cap,
                            size_t* residual_len, Impl impl = Impl::AUTO, int threads = 0);

/**
 * Encodes a SpectrumKV page (cfg->codec == KVXFER_CODEC_SPECTRUM): token t of
 * `src` at precision tier token_tiers[t] (kvxfer_tier_t values; T entries,
 * NULL only when T == 0).  The format is docs/FORMAT.md section 6.  One code
 * path (no Impl choice); chunks run in parallel on `threads` OpenMP threads
 * (0: KVXFER_CODEC_THREADS, else one per core) when every token's fields
 * start on a byte boundary (H a multiple of 8 does it), else on one thread.
 * The bytes are the same for every thread count.  Same outputs and errors as
 * kvxfer_page_encode_tiered (include/kvxfer/kvxfer.h).
 */
kvxfer_result_t encode_page_tiered(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, const uint8_t* token_tiers,
                                   void* anchor, size_t anchor_cap, size_t* anchor_len,
                                   void* residual, size_t residual_cap, size_t* residual_len,
                                   int threads = 0);

/**
 * The encoder cfg->codec needs: encode_page_tiered with `token_tiers` for a
 * codec with token tiers (codec/page_codec.h), else encode_page (which
 * ignores them).
 */
kvxfer_result_t encode_any_page(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                const kvxfer_page_layout_t* src, const uint8_t* token_tiers,
                                void* anchor, size_t anchor_cap, size_t* anchor_len, void* residual,
                                size_t residual_cap, size_t* residual_len, Impl impl = Impl::AUTO,
                                int threads = 0);

/** kvxfer_page_get_tiers: the precision map of a validated SpectrumKV anchor section. */
kvxfer_result_t get_page_tiers(const void* anchor, size_t anchor_len, uint8_t* token_tiers,
                               int64_t num_tokens);

/** Decodes any page, SpectrumKV included (those on one thread whatever impl/threads say). */
kvxfer_result_t decode_page(const void* anchor, size_t anchor_len, const void* residual,
                            size_t residual_len, const kvxfer_page_id_t* expect,
                            const kvxfer_page_layout_t* dst, Impl impl = Impl::AUTO,
                            int threads = 0);

/** Candidate alphas of the auto rule (docs/FORMAT.md section 2.6). */
constexpr float kAlphaCandidates[] = {0.0f, 1.0f, 2.0f, 5.0f, 10.0f, 20.0f, 50.0f, 100.0f, 255.0f};
constexpr int kCalibrationChunksPerPage = 8;

/** Squared reconstruction errors of one candidate on the calibration sample. */
struct CalibrationError {
  float alpha;
  double full, anchor;
};

/**
 * The alpha=auto rule.  `errors`, if non-NULL, receives the error of every
 * candidate (for tests and benchmarks).
 */
kvxfer_result_t calibrate_alpha(const kvxfer_codec_config_t* cfg, const kvxfer_page_layout_t* pages,
                                int32_t num_pages, float* alpha,
                                std::vector<CalibrationError>* errors = nullptr);

kvxfer_result_t inspect_section(const void* section, size_t len, kvxfer_page_info_t* info);

}  // namespace kvxfer::codec
