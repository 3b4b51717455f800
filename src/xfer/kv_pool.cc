#include "xfer/kv_pool.h"

#include <algorithm>
#include <cinttypes>

#include "codec/kv_desc.h"
#include "codec/page.h"
#include "common/error.h"
#include "common/struct_abi.h"
#include "xfer/device.h"
#include "xfer/engine.h"

namespace kvxfer::xfer {

kvxfer_result_t KvPool::create(const kvxfer_kv_pool_desc_t* desc, std::unique_ptr<KvPool>* out) {
  KVXFER_REQUIRE(desc != nullptr && out != nullptr, "KV pool: desc or pool is NULL");
  kvxfer_kv_pool_desc_t d;
  KVXFER_CHECK(read_struct_probed(desc, &d, codec::copy_in_checked, "KV pool: "));
  KVXFER_REQUIRE(d.num_layers >= 1 && d.num_blocks >= 1 && d.block_size >= 1,
                 "KV pool: num_layers %d, num_blocks %" PRId64
                 " and block_size %d must be positive",
                 d.num_layers, d.num_blocks, d.block_size);
  KVXFER_REQUIRE(d.k_layers != nullptr && d.v_layers != nullptr,
                 "KV pool: k_layers and v_layers must both be given");
  KVXFER_REQUIRE(d.device >= -1, "KV pool: device %d is not -1 (host) or a CUDA ordinal", d.device);
  xfer::DeviceCodec* dev = nullptr;
  if (d.device >= 0) KVXFER_CHECK(xfer::usable_device_codec(d.device, "KV pool: the pool", &dev));
  KVXFER_REQUIRE(d.num_blocks <= codec::kMaxDescBlocks / d.num_layers,
                 "KV pool: num_layers %d x num_blocks %" PRId64 " exceeds 2^32 blocks",
                 d.num_layers, d.num_blocks);
  auto p = std::unique_ptr<KvPool>(new KvPool());
  const size_t L = static_cast<size_t>(d.num_layers);
  p->k_layers_.resize(L);
  p->v_layers_.resize(L);
  KVXFER_REQUIRE(codec::copy_in_checked(d.k_layers, L * sizeof(void*), p->k_layers_.data()) &&
                     codec::copy_in_checked(d.v_layers, L * sizeof(void*), p->v_layers_.data()),
                 "KV pool: k_layers or v_layers (%d entries) is not readable memory", d.num_layers);
  // The pool as one descriptor of every block, so that it is checked by the
  // same rules, words and probes as a request's (codec/kv_desc.h).
  const int64_t H = int64_t{d.kv_heads} * d.head_dim;
  KVXFER_REQUIRE(d.kv_heads >= 1 && d.head_dim >= 1 && H <= codec::kMaxDescChannels,
                 "KV pool: kv_heads %d x head_dim %d must be positive and at most %d channels",
                 d.kv_heads, d.head_dim, codec::kMaxDescChannels);
  KVXFER_REQUIRE(
      d.dtype == KVXFER_DTYPE_BF16 || d.dtype == KVXFER_DTYPE_FP16 || d.dtype == KVXFER_DTYPE_FP32,
      "KV pool: dtype %d is not BF16, FP16 or FP32", static_cast<int>(d.dtype));
  const int64_t es = static_cast<int64_t>(codec::dtype_size(d.dtype));
  p->row_stride_ = d.row_stride == 0 ? H : d.row_stride;
  KVXFER_REQUIRE(p->row_stride_ >= H && p->row_stride_ <= (int64_t{1} << 40),
                 "KV pool: row_stride %" PRId64 " is not in [%" PRId64 " channels, 2^40]",
                 d.row_stride, H);
  // As a request's descriptor (codec/kv_desc.cc): a block's rows within
  // 2^62 bytes, so that the products below cannot overflow.
  KVXFER_REQUIRE(p->row_stride_ <= (int64_t{1} << 62) / d.block_size / es,
                 "KV pool: a block of %d rows of row_stride %" PRId64 " exceeds 2^62 bytes",
                 d.block_size, p->row_stride_);
  const int64_t extent = (int64_t{d.block_size} - 1) * p->row_stride_ * es + H * es;
  p->block_stride_ =
      d.block_stride == 0 ? int64_t{d.block_size} * p->row_stride_ * es : d.block_stride;
  KVXFER_REQUIRE(p->block_stride_ >= extent,
                 "KV pool: block_stride %" PRId64 " bytes is smaller than a block's %" PRId64
                 " bytes (block_size %d rows of row_stride %" PRId64 ")",
                 d.block_stride, extent, d.block_size, p->row_stride_);
  KVXFER_REQUIRE(p->block_stride_ <= (int64_t{1} << 62) / d.num_blocks,
                 "KV pool: num_blocks %" PRId64 " x block_stride %" PRId64 " exceeds 2^62 bytes",
                 d.num_blocks, p->block_stride_);
  // No two blocks of the pool may share a byte: a receive would write one
  // page's rows over another's.  Every region is an arithmetic progression
  // of the same stride, so two regions meet iff some difference of their
  // block indices m brings their bases within a block's extent, and then
  // some difference of row indices k brings two rows within a row's bytes
  // (K and V rows may interleave: vLLM's [.., block_size, K|V] layouts).
  std::vector<std::pair<const uint8_t*, std::string>> bases;
  for (size_t l = 0; l < L; ++l) {
    bases.emplace_back(p->k_layers_[l], strprintf("layer %zu K", l));
    bases.emplace_back(p->v_layers_[l], strprintf("layer %zu V", l));
  }
  const int64_t S = p->block_stride_, last = d.num_blocks - 1;
  const int64_t Sr = p->row_stride_ * es, R = H * es, rows = d.block_size - 1;
  auto rows_meet = [&](int64_t gap) { return codec::strided_rows_meet(gap, -rows, rows, Sr, R); };
  for (size_t i = 0; i < bases.size(); ++i)
    for (size_t j = i + 1; j < bases.size(); ++j) {
      const int64_t delta = static_cast<int64_t>(reinterpret_cast<uintptr_t>(bases[j].first) -
                                                 reinterpret_cast<uintptr_t>(bases[i].first));
      // b_j - b_i = m: the gap delta + m * S closest to 0 is at m near -delta / S.
      const int64_t m0 = -delta / S;
      for (int64_t m : {m0 - 1, m0, m0 + 1}) {
        if (m < -last || m > last) continue;
        const int64_t gap = delta + m * S;
        KVXFER_REQUIRE(!rows_meet(gap),
                       "KV pool: %s and %s overlap (a block of one is %" PRId64
                       " bytes from a block of the other; a block spans %" PRId64
                       " in rows of %" PRId64 " bytes every %" PRId64 ")",
                       bases[i].second.c_str(), bases[j].second.c_str(), gap, extent, R, Sr);
      }
    }
  std::vector<void*> k(L * static_cast<size_t>(d.num_blocks)), v(k.size());
  for (size_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < d.num_blocks; ++b) {
      const size_t i = l * static_cast<size_t>(d.num_blocks) + static_cast<size_t>(b);
      k[i] = p->k_layers_[l] + b * p->block_stride_;
      v[i] = p->v_layers_[l] + b * p->block_stride_;
    }
  kvxfer_kv_desc_t kd = KVXFER_KV_DESC_INITIALIZER;
  kd.num_layers = d.num_layers;
  kd.kv_heads = d.kv_heads;
  kd.head_dim = d.head_dim;
  kd.dtype = d.dtype;
  kd.num_tokens = d.num_blocks * d.block_size;
  kd.block_size = d.block_size;
  kd.row_stride = p->row_stride_;
  kd.num_blocks = d.num_blocks;
  kd.k_blocks = k.data();
  kd.v_blocks = v.data();
  kd.device = d.device;
  codec::KvDesc shape;
  KVXFER_CHECK(codec::validate_kv_desc(&kd, codec::KvAccess::kWrite, "KV pool: ", &shape));
  p->d_ = d;
  p->d_.k_layers = nullptr;  // the copies above are what is used
  p->d_.v_layers = nullptr;
  *out = std::move(p);
  return KVXFER_SUCCESS;
}

kvxfer_result_t KvPool::describe(const kvxfer_kv_blocks_t* blocks, bool writes,
                                 std::vector<void*>* k, std::vector<void*>* v,
                                 kvxfer_kv_desc_t* out) const {
  KVXFER_REQUIRE(blocks != nullptr, "blocks is NULL");
  kvxfer_kv_blocks_t b;
  KVXFER_CHECK(read_struct_probed(blocks, &b, codec::copy_in_checked));
  KVXFER_REQUIRE(b.num_tokens >= 0 && b.num_tokens <= d_.num_blocks * d_.block_size,
                 "num_tokens %" PRId64 " is outside [0, %" PRId64 "] (the pool's %" PRId64
                 " blocks of %d tokens)",
                 b.num_tokens, d_.num_blocks * d_.block_size, d_.num_blocks, d_.block_size);
  KVXFER_REQUIRE(b.head_begin >= 0 && b.head_begin < d_.kv_heads && b.num_heads >= 0 &&
                     b.num_heads <= d_.kv_heads - b.head_begin,
                 "heads [%d, %d + %d) are outside the pool's %d KV heads", b.head_begin,
                 b.head_begin, b.num_heads, d_.kv_heads);
  const int64_t used = (b.num_tokens + d_.block_size - 1) / d_.block_size;
  KVXFER_REQUIRE(b.num_block_ids >= used,
                 "num_block_ids %" PRId64 " cannot hold %" PRId64 " tokens of block size %d",
                 b.num_block_ids, b.num_tokens, d_.block_size);
  std::vector<int32_t> ids(static_cast<size_t>(used));
  if (used > 0)
    KVXFER_REQUIRE(
        b.block_ids != nullptr &&
            codec::copy_in_checked(b.block_ids, ids.size() * sizeof(int32_t), ids.data()),
        "block_ids (%p, %" PRId64 " ids used) is not readable memory",
        static_cast<const void*>(b.block_ids), used);
  for (size_t i = 0; i < ids.size(); ++i)
    KVXFER_REQUIRE(ids[i] >= 0 && ids[i] < d_.num_blocks,
                   "block_ids[%zu] = %d is not a block of the pool [0, %" PRId64 ")", i, ids[i],
                   d_.num_blocks);
  if (writes) {  // a receive: each block once
    std::vector<std::pair<int32_t, size_t>> sorted(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) sorted[i] = {ids[i], i};
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 1; i < sorted.size(); ++i)
      KVXFER_REQUIRE(sorted[i].first != sorted[i - 1].first,
                     "block_ids[%zu] and block_ids[%zu] are both block %d: a receive writes each "
                     "block once",
                     sorted[i - 1].second, sorted[i].second, sorted[i].first);
  }
  const int32_t heads = b.num_heads == 0 ? d_.kv_heads - b.head_begin : b.num_heads;
  const int64_t head_off =
      int64_t{b.head_begin} * d_.head_dim * static_cast<int64_t>(codec::dtype_size(d_.dtype));
  const size_t L = k_layers_.size();
  k->resize(L * ids.size());
  v->resize(k->size());
  for (size_t l = 0; l < L; ++l)
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t off = ids[i] * block_stride_ + head_off;
      (*k)[l * ids.size() + i] = k_layers_[l] + off;
      (*v)[l * ids.size() + i] = v_layers_[l] + off;
    }
  kvxfer_kv_desc_t kd = KVXFER_KV_DESC_INITIALIZER;
  kd.num_layers = d_.num_layers;
  kd.kv_heads = heads;
  kd.head_dim = d_.head_dim;
  kd.dtype = d_.dtype;
  kd.num_tokens = b.num_tokens;
  kd.block_size = d_.block_size;
  kd.row_stride = row_stride_;
  kd.num_blocks = std::max<int64_t>(used, 1);
  kd.k_blocks = k->empty() ? nullptr : k->data();
  kd.v_blocks = v->empty() ? nullptr : v->data();
  kd.device = d_.device;
  *out = kd;
  return KVXFER_SUCCESS;
}

void KvPool::track(const std::shared_ptr<Request>& r) {
  std::lock_guard<std::mutex> lk(mu_);
  users_.erase(std::remove_if(users_.begin(), users_.end(),
                              [](const std::weak_ptr<Request>& w) { return w.expired(); }),
               users_.end());
  users_.push_back(r);
}

int64_t KvPool::in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t n = 0;
  for (const std::weak_ptr<Request>& w : users_) {
    const std::shared_ptr<Request> r = w.lock();
    if (r == nullptr) continue;
    std::lock_guard<std::mutex> rlk(r->mu);
    n += r->stage != KVXFER_STAGE_COMPLETE && r->stage != KVXFER_STAGE_ERROR;
  }
  return n;
}

}  // namespace kvxfer::xfer
