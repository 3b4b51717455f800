#include "codec/kv_desc.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>

#include "codec/format.h"
#include "codec/page.h"
#include "common/error.h"
#include "common/struct_abi.h"

namespace kvxfer::codec {
namespace {

constexpr size_t kBatch = 1024;  // IOV_MAX: iovecs per process_vm_* call

/**
 * Memory access that reports EFAULT instead of faulting.  process_vm_readv /
 * writev on this process first; where a seccomp policy refuses them (EPERM,
 * ENOSYS), a pipe: write(2) from and read(2) into the address give EFAULT
 * for memory that cannot be read or written.
 */
class Prober {
 public:
  ~Prober() {
    if (pipe_[0] >= 0) close(pipe_[0]);
    if (pipe_[1] >= 0) close(pipe_[1]);
  }
  /** Copies `len` bytes at `src` into `dst`; false if any of them is unreadable. */
  bool copy_in(const void* src, size_t len, void* dst) {
    const std::vector<uint8_t*> at{static_cast<uint8_t*>(const_cast<void*>(src))};
    return read_runs(at, len, static_cast<uint8_t*>(dst)) == 1;
  }
  /**
   * Copies `len` bytes at each address to `dst`, back to back; returns how
   * many addresses, from the front, could be read.
   */
  size_t read_runs(const std::vector<uint8_t*>& addr, size_t len, uint8_t* dst) {
    return transfer(addr, len, dst, false);
  }
  /** Reads one byte at each address into `val`; returns how many, from the front, could be read. */
  size_t read_bytes(const std::vector<uint8_t*>& addr, std::vector<uint8_t>* val) {
    val->assign(addr.size(), 0);
    return transfer(addr, 1, val->data(), false);
  }
  /** Writes val[i] at addr[i]; returns how many, from the front, could be written. */
  size_t write_bytes(const std::vector<uint8_t*>& addr, std::vector<uint8_t>* val) {
    return transfer(addr, 1, val->data(), true);
  }

 private:
  /**
   * `len` bytes between each address and `val + i * len` (read: from the
   * address), with one process_vm_readv/writev per kBatch addresses; returns
   * how many addresses, from the front, were done.
   */
  size_t transfer(const std::vector<uint8_t*>& addr, size_t len, uint8_t* val, bool write) {
    if (len == 0) return addr.size();
    size_t done = 0;
    std::vector<iovec> r;
    while (done < addr.size() && use_vm_) {
      const size_t k = std::min(kBatch, addr.size() - done);
      iovec l{val + done * len, k * len};
      r.resize(k);
      for (size_t i = 0; i < k; ++i) r[i] = iovec{addr[done + i], len};
      // Partial transfers stop at the first iovec that faults (process_vm_readv(2)).
      const ssize_t n = write ? process_vm_writev(getpid(), &l, 1, r.data(), k, 0)
                              : process_vm_readv(getpid(), &l, 1, r.data(), k, 0);
      if (n == static_cast<ssize_t>(k * len)) {
        done += k;
        continue;
      }
      if (n >= 0) return done + static_cast<size_t>(n) / len;
      if (errno == EFAULT) return done;
      use_vm_ = false;  // refused by policy: the pipe from here on
    }
    for (; done < addr.size(); ++done)
      for (size_t off = 0; off < len;) {
        const size_t k = std::min<size_t>(len - off, 4096);
        uint8_t* v = val + done * len + off;
        if (!(write ? pipe_copy(v, addr[done] + off, k) : pipe_copy(addr[done] + off, v, k)))
          return done;
        off += k;
      }
    return done;
  }
  /** write(2) `src` into the pipe, read(2) it into `dst`: EFAULT on either side is false. */
  bool pipe_copy(const void* src, void* dst, size_t len) {
    if (pipe_[0] < 0 && pipe2(pipe_, O_CLOEXEC) != 0) return false;
    if (write(pipe_[1], src, len) != static_cast<ssize_t>(len)) return false;
    if (read(pipe_[0], dst, len) == static_cast<ssize_t>(len)) return true;
    // The destination faulted: drain what is left in the pipe.
    uint8_t sink[4096];
    (void)!read(pipe_[0], sink, len);
    return false;
  }

  bool use_vm_ = true;
  int pipe_[2] = {-1, -1};
};

}  // namespace

bool copy_in_checked(const void* src, size_t len, void* dst) {
  Prober probe;
  return probe.copy_in(src, len, dst);
}

bool read_string_checked(const char* src, size_t max, std::string* out) {
  out->clear();
  Prober probe;
  constexpr uintptr_t kPage = 4096;
  char buf[kPage];
  for (const char* p = src; out->size() < max;) {
    // To the end of this page: the next may not be mapped.
    const size_t n =
        std::min<size_t>(kPage - reinterpret_cast<uintptr_t>(p) % kPage, max - out->size());
    if (!probe.copy_in(p, n, buf)) return false;
    const size_t len = strnlen(buf, n);
    out->append(buf, len);
    if (len < n) return true;
    p += n;
  }
  return false;
}

kvxfer_result_t read_kv_desc(const kvxfer_kv_desc_t* kv, const std::string& prefix,
                             kvxfer_kv_desc_t* out) {
  return read_struct_probed(kv, out, copy_in_checked, prefix.c_str());
}

kvxfer_result_t validate_kv_desc(const kvxfer_kv_desc_t* kv, KvAccess access,
                                 const std::string& prefix, KvDesc* out) {
  const char* p = prefix.c_str();
  kvxfer_kv_desc_t d;
  KVXFER_CHECK(read_kv_desc(kv, prefix, &d));
  Prober probe;
  KVXFER_REQUIRE(d.num_layers >= 1 && d.kv_heads >= 1 && d.head_dim >= 1,
                 "%snum_layers %d, kv_heads %d and head_dim %d must be positive", p, d.num_layers,
                 d.kv_heads, d.head_dim);
  const int64_t H = int64_t{d.kv_heads} * d.head_dim;
  KVXFER_REQUIRE(H <= kMaxDescChannels, "%skv_heads * head_dim = %" PRId64 " exceeds %d channels",
                 p, H, kMaxDescChannels);
  KVXFER_REQUIRE(
      d.dtype == KVXFER_DTYPE_BF16 || d.dtype == KVXFER_DTYPE_FP16 || d.dtype == KVXFER_DTYPE_FP32,
      "%sdtype %d is not BF16, FP16 or FP32", p, static_cast<int>(d.dtype));
  KVXFER_REQUIRE(d.num_tokens >= 0 && d.num_tokens <= kMaxDescTokens,
                 "%snum_tokens %" PRId64 " outside [0, 2^32]", p, d.num_tokens);
  KVXFER_REQUIRE(d.device >= -1, "%sdevice %d is not -1 (host) or a CUDA ordinal", p, d.device);
  const size_t es = dtype_size(d.dtype);
  KvDesc o;
  o.channels = H;
  o.row_stride = d.row_stride == 0 ? H : d.row_stride;
  // num_layers * 2 * num_tokens * H * es: at most 2^31 * 2 * 2^32 * 2^16 * 4, so checked.
  uint64_t bytes = 0;
  const bool overflow =
      __builtin_mul_overflow(static_cast<uint64_t>(d.num_layers) * 2,
                             static_cast<uint64_t>(d.num_tokens) * static_cast<uint64_t>(H) * es,
                             &bytes) ||
      bytes > (uint64_t{1} << 62);
  KVXFER_REQUIRE(!overflow,
                 "%sthe KV (num_layers %d x K,V x num_tokens %" PRId64 " x %" PRId64
                 " channels of %zu bytes) exceeds 2^62 bytes",
                 p, d.num_layers, d.num_tokens, H, es);
  o.kv_bytes = bytes;
  if (d.num_tokens == 0) {
    *out = std::move(o);
    return KVXFER_SUCCESS;
  }
  KVXFER_REQUIRE(d.block_size >= 1, "%sblock_size %d must be positive", p, d.block_size);
  KVXFER_REQUIRE(o.row_stride >= H, "%srow_stride %" PRId64 " is smaller than %" PRId64 " channels",
                 p, o.row_stride, H);
  KVXFER_REQUIRE(o.row_stride <= (int64_t{1} << 62) / d.block_size / static_cast<int64_t>(es),
                 "%sa block of %d rows of row_stride %" PRId64 " exceeds 2^62 bytes", p,
                 d.block_size, o.row_stride);
  o.blocks_used = (d.num_tokens + d.block_size - 1) / d.block_size;
  KVXFER_REQUIRE(d.num_blocks >= o.blocks_used,
                 "%snum_blocks %" PRId64 " cannot hold %" PRId64 " tokens of block size %d", p,
                 d.num_blocks, d.num_tokens, d.block_size);
  KVXFER_REQUIRE(d.num_blocks <= kMaxDescBlocks / d.num_layers,
                 "%snum_layers %d x num_blocks %" PRId64 " exceeds 2^32 block pointers", p,
                 d.num_layers, d.num_blocks);
  KVXFER_REQUIRE(d.k_blocks != nullptr && d.v_blocks != nullptr,
                 "%sk_blocks and v_blocks must both be given", p);

  // The used part of every layer's table, copied without trusting it.
  const size_t L = static_cast<size_t>(d.num_layers), used = static_cast<size_t>(o.blocks_used);
  for (kvxfer_kv_kind_t k : {KVXFER_KV_KEY, KVXFER_KV_VALUE}) {
    void* const* table = k == KVXFER_KV_KEY ? d.k_blocks : d.v_blocks;
    std::vector<void*>& copy = k == KVXFER_KV_KEY ? o.k_blocks : o.v_blocks;
    copy.resize(L * used);
    std::vector<uint8_t*> rows(L);  // each layer's entries
    for (size_t l = 0; l < L; ++l)
      rows[l] = reinterpret_cast<uint8_t*>(const_cast<void**>(table + l * d.num_blocks));
    const size_t l =
        probe.read_runs(rows, used * sizeof(void*), reinterpret_cast<uint8_t*>(copy.data()));
    KVXFER_REQUIRE(
        l == L, "%s%s_blocks (%p): entries [%zu, %zu) of layer %zu are not readable memory", p,
        k == KVXFER_KV_KEY ? "k" : "v", static_cast<const void*>(table),
        l * static_cast<size_t>(d.num_blocks), l * static_cast<size_t>(d.num_blocks) + used, l);
  }
  // Every block a token lives in: present, aligned, and (host memory) its
  // first and last used byte accessible, with every page between them mapped.
  // The two bytes go through process_vm_readv/writev (batched calls); the
  // pages between through mincore(2), which walks the page tables without
  // pinning them.  A one-byte probe of every page took 17-22 ms (send) and
  // 32-40 ms (recv) for 64 MiB of KV in 4096 blocks; this takes 9 and 11-13 ms.
  // A page between them that is mapped but protected (PROT_NONE, or
  // read-only for a receiver) is not caught.
  const size_t row = static_cast<size_t>(o.row_stride) * es;
  const int64_t last_rows = d.num_tokens - (o.blocks_used - 1) * int64_t{d.block_size};
  std::vector<uint8_t*> addr;                              // first, last byte of each block
  std::vector<std::pair<kvxfer_kv_kind_t, size_t>> where;  // (kind, table index) of addr[i]
  for (kvxfer_kv_kind_t k : {KVXFER_KV_KEY, KVXFER_KV_VALUE}) {
    const std::vector<void*>& t = k == KVXFER_KV_KEY ? o.k_blocks : o.v_blocks;
    for (size_t i = 0; i < t.size(); ++i) {
      const size_t l = i / used, b = i % used;
      KVXFER_REQUIRE(t[i] != nullptr, "%slayer %zu %s block %zu is NULL", p, l, kv_kind_name(k), b);
      KVXFER_REQUIRE(reinterpret_cast<uintptr_t>(t[i]) % es == 0,
                     "%slayer %zu %s block %zu at %p is not aligned to its %zu-byte %s elements", p,
                     l, kv_kind_name(k), b, t[i], es, dtype_name(d.dtype));
      if (d.device >= 0 || access == KvAccess::kNone) continue;
      const size_t rows = b + 1 == used ? static_cast<size_t>(last_rows) : d.block_size;
      uint8_t* base = static_cast<uint8_t*>(t[i]);
      addr.push_back(base);
      addr.push_back(base + (rows - 1) * row + static_cast<size_t>(H) * es - 1);
      where.emplace_back(k, i);
      where.emplace_back(k, i);
    }
  }
  // A receive writes every block: no two may share a byte, or one page's
  // rows would land on another's and both report COMPLETE.  Blocks share
  // one row stride, so two whose byte ranges meet share a byte iff two of
  // their rows do (rows of interleaved K|V layouts lie between each other's).
  if (access == KvAccess::kWrite) {
    struct Extent {
      uintptr_t begin, end;
      kvxfer_kv_kind_t kind;
      size_t index;
    };
    std::vector<Extent> ext;
    ext.reserve(o.k_blocks.size() + o.v_blocks.size());
    for (kvxfer_kv_kind_t k : {KVXFER_KV_KEY, KVXFER_KV_VALUE}) {
      const std::vector<void*>& t = k == KVXFER_KV_KEY ? o.k_blocks : o.v_blocks;
      for (size_t i = 0; i < t.size(); ++i) {
        const size_t rows = i % used + 1 == used ? static_cast<size_t>(last_rows) : d.block_size;
        const uintptr_t b = reinterpret_cast<uintptr_t>(t[i]);
        ext.push_back({b, b + (rows - 1) * row + static_cast<size_t>(H) * es, k, i});
      }
    }
    std::sort(ext.begin(), ext.end(),
              [](const Extent& x, const Extent& y) { return x.begin < y.begin; });
    const int64_t R = H * static_cast<int64_t>(es), S = static_cast<int64_t>(row);
    constexpr size_t kMaxInterleaved = 1024;  // blocks checked row by row against one
    for (size_t j = 0; j < ext.size(); ++j)
      for (size_t k = j + 1; k < ext.size() && ext[k].begin < ext[j].end; ++k) {
        KVXFER_REQUIRE(k - j <= kMaxInterleaved,
                       "%smore than %zu blocks start within the bytes of layer %zu %s block %zu: "
                       "a layout this interleaved is not supported",
                       p, kMaxInterleaved, ext[j].index / used, kv_kind_name(ext[j].kind),
                       ext[j].index % used);
        // Row r of j and row m of k: m - r in [-(rows of j - 1), rows of k - 1].
        const int64_t gap = static_cast<int64_t>(ext[k].begin - ext[j].begin);
        const int64_t rj = static_cast<int64_t>((ext[j].end - ext[j].begin - R) / S);
        const int64_t rk = static_cast<int64_t>((ext[k].end - ext[k].begin - R) / S);
        KVXFER_REQUIRE(!strided_rows_meet(gap, -rj, rk, S, R),
                       "%slayer %zu %s block %zu (%p) and layer %zu %s block %zu (%p) share "
                       "bytes: a receive would write one page's rows over another's",
                       p, ext[j].index / used, kv_kind_name(ext[j].kind), ext[j].index % used,
                       reinterpret_cast<void*>(ext[j].begin), ext[k].index / used,
                       kv_kind_name(ext[k].kind), ext[k].index % used,
                       reinterpret_cast<void*>(ext[k].begin));
      }
  }
  auto block_at = [&](size_t j) {
    const auto [k, i] = where[j];
    return k == KVXFER_KV_KEY ? o.k_blocks[i] : o.v_blocks[i];
  };
  auto bad_block = [&](size_t j, const char* which, const void* at, const char* how) {
    const auto [k, i] = where[j];
    return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                     "%slayer %zu %s block %zu at %p: its %s byte (%p) is not %s memory", p,
                     i / used, kv_kind_name(k), i % used, block_at(j), which, at, how);
  };
  if (!addr.empty()) {
    std::vector<uint8_t> val;
    size_t ok = probe.read_bytes(addr, &val);
    const char* how = "readable";
    if (ok == addr.size() && access == KvAccess::kWrite) {
      ok = probe.write_bytes(addr, &val);  // the bytes just read, written back
      how = "writable";
    }
    if (ok < addr.size()) return bad_block(ok, ok % 2 == 0 ? "first" : "last", addr[ok], how);
    // The pages strictly between each block's first and last byte, as a few
    // merged ranges (blocks of one pool are adjacent).  Two ranges at most
    // two pages apart merge: the pages between them hold the last byte of
    // the first's block and the first byte of the second's, both probed.
    const uintptr_t pg = 4096;
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;  // [begin, end) page-aligned
    for (size_t j = 0; j < addr.size(); j += 2) {
      const uintptr_t a = (reinterpret_cast<uintptr_t>(addr[j]) / pg + 1) * pg;
      const uintptr_t e = reinterpret_cast<uintptr_t>(addr[j + 1]) / pg * pg;
      if (a < e) ranges.emplace_back(a, e);
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<unsigned char> vec;
    for (size_t q = 0; q < ranges.size();) {
      uintptr_t a = ranges[q].first, e = ranges[q].second;
      for (++q; q < ranges.size() && ranges[q].first <= e + 2 * pg; ++q)
        e = std::max(e, ranges[q].second);
      vec.resize(std::max(vec.size(), static_cast<size_t>((e - a) / pg)));
      if (mincore(reinterpret_cast<void*>(a), e - a, vec.data()) == 0 || errno != ENOMEM) continue;
      // Unmapped somewhere in [a, e): find the block and the page.
      for (size_t j = 0; j < addr.size(); j += 2) {
        const uintptr_t ba = (reinterpret_cast<uintptr_t>(addr[j]) / pg + 1) * pg;
        const uintptr_t be = reinterpret_cast<uintptr_t>(addr[j + 1]) / pg * pg;
        if (be <= a || ba >= e) continue;
        for (uintptr_t x = ba; x < be; x += pg)
          if (mincore(reinterpret_cast<void*>(x), pg, vec.data()) != 0 && errno == ENOMEM)
            return bad_block(j, "middle", reinterpret_cast<void*>(x), "mapped");
      }
    }
  }
  *out = std::move(o);
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::codec
