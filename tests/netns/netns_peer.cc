// One rank of the "two real hosts" test (tests/netns/run.sh): a KV transfer
// with Lynx progressive between two processes, each in its own network
// namespace, through the public C API only (libkvxfer.so).
//
//   netns_peer --role recv --id FILE [options]   rank 0: makes the unique id,
//                                                writes it to FILE, receives
//   netns_peer --role send --id FILE [options]   rank 1: waits for FILE, sends
//
// Options (both sides must agree on the shape):
//   --layers N --kv-heads N --head-dim N --tokens N   KV shape (bf16)
//   --page-tokens N    tokens per page (sender; the receiver follows)
//   --timeout-ms N     kvxfer_comm_init deadline and transfer inactivity timeout
//   --wait-s N         how long to wait for FILE (send) or FILE.done (recv)
//
// The addresses come from the environment, as a deployment would set them:
// KVXFER_BOOTSTRAP_ADDR (receiver: where the id's root listens) and
// KVXFER_BIND_ADDR (both: where the libfabric endpoints bind).
//
// Output: key=value lines on stdout.  The receiver reports the stage
// timestamps relative to its kvxfer_recv (t_posted), the byte counts, and a
// summary of kvxfer_request_get_arrivals: when the last anchor section and
// the first, half-of-the-bytes and last residual sections landed.  It also
// checks every received value, bit for bit, against the public codec's own
// encode + decode of the sender's pages (verify=ok).
//
// The sender writes FILE.done once its request is final; the receiver waits
// for it (bounded) before destroying its communicator, so the sender's
// confirmation is never cut off.
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace {

struct Options {
  std::string role, id_file;
  int32_t layers = 8, kv_heads = 8, head_dim = 128;
  int64_t tokens = 1024;
  int32_t page_tokens = 256;
  int32_t timeout_ms = 20000;
  int32_t wait_s = 30;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "netns_peer: %s\nusage: netns_peer --role send|recv --id FILE [--layers N] "
               "[--kv-heads N] [--head-dim N] [--tokens N] [--page-tokens N] [--timeout-ms N] "
               "[--wait-s N]\n",
               why);
  std::exit(2);
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const char* v = argv[++i];
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    const bool numeric = end != v && *end == '\0' && n > 0 && n <= (1LL << 30);
    if (a == "--role") {
      o->role = v;
    } else if (a == "--id") {
      o->id_file = v;
    } else if (!numeric) {
      usage(("bad value for " + a + ": " + v).c_str());
    } else if (a == "--layers") {
      o->layers = static_cast<int32_t>(n);
    } else if (a == "--kv-heads") {
      o->kv_heads = static_cast<int32_t>(n);
    } else if (a == "--head-dim") {
      o->head_dim = static_cast<int32_t>(n);
    } else if (a == "--tokens") {
      o->tokens = n;
    } else if (a == "--page-tokens") {
      o->page_tokens = static_cast<int32_t>(n);
    } else if (a == "--timeout-ms") {
      o->timeout_ms = static_cast<int32_t>(n);
    } else if (a == "--wait-s") {
      o->wait_s = static_cast<int32_t>(n);
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (o->role != "send" && o->role != "recv") usage("--role must be send or recv");
  if (o->id_file.empty()) usage("--id FILE is required");
  return true;
}

int64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void sleep_ms(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/** Waits up to `seconds` for `path` to exist; true if it does. */
bool wait_for_file(const std::string& path, int seconds) {
  const int64_t deadline = mono_ns() + static_cast<int64_t>(seconds) * 1000000000LL;
  struct stat st;
  while (stat(path.c_str(), &st) != 0) {
    if (mono_ns() > deadline) return false;
    sleep_ms(20);
  }
  return true;
}

/** Writes `n` bytes to `path` atomically (a temporary file, then rename). */
bool write_file(const std::string& path, const void* data, size_t n) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(data, 1, n, f) == n;
  if (std::fclose(f) != 0 || !ok) return false;
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// ---------------------------------------------------------------------------
// The KV: a pure function of (layer, kind, token, channel), so the receiver
// can rebuild the sender's pages to check what it got.
// ---------------------------------------------------------------------------
uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (values here are finite)
  return static_cast<uint16_t>(u >> 16);
}

/** KV-like values: per-channel scale and offset, a few outlier channels. */
uint16_t kv_value(int32_t layer, int kind, int64_t token, int32_t channel) {
  const uint64_t h =
      splitmix((static_cast<uint64_t>(layer) << 48) ^ (static_cast<uint64_t>(kind) << 47) ^
               (static_cast<uint64_t>(token) << 17) ^ static_cast<uint64_t>(channel));
  // Sum of two uniforms in [-1, 1): a triangular, roughly bell-shaped value.
  const float u1 = static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f;
  const float u2 = static_cast<float>((h >> 24) & 0xffffff) / 8388608.0f - 1.0f;
  const float scale = (channel % 17 == 3) ? 20.0f : 1.0f + 0.1f * static_cast<float>(channel % 5);
  return to_bf16(scale * (u1 + u2) + 0.05f * static_cast<float>(channel % 7));
}

/** A paged bf16 KV cache: per layer, K and V block tables of `block` tokens. */
struct PagedKV {
  int32_t L, H;
  int64_t T;
  int32_t block;
  int64_t nblocks;
  std::vector<std::vector<uint16_t>> storage;
  std::vector<void*> k, v;
  kvxfer_kv_desc_t desc = KVXFER_KV_DESC_INITIALIZER;

  PagedKV(const Options& o, int32_t block_tokens)
      : L(o.layers), H(o.kv_heads * o.head_dim), T(o.tokens), block(block_tokens) {
    nblocks = std::max<int64_t>(1, (T + block - 1) / block);
    storage.resize(static_cast<size_t>(2 * L * nblocks));
    for (auto& s : storage) s.assign(static_cast<size_t>(block) * H, 0xA5A5);
    for (int64_t i = 0; i < L * nblocks; ++i) k.push_back(storage[i].data());
    for (int64_t i = 0; i < L * nblocks; ++i) v.push_back(storage[L * nblocks + i].data());
    desc.num_layers = L;
    desc.kv_heads = o.kv_heads;
    desc.head_dim = o.head_dim;
    desc.dtype = KVXFER_DTYPE_BF16;
    desc.num_tokens = T;
    desc.block_size = block;
    desc.row_stride = H;
    desc.num_blocks = nblocks;
    desc.k_blocks = k.data();
    desc.v_blocks = v.data();
  }
  uint16_t* row(int32_t l, int kind, int64_t t) {
    void* const* b = (kind == 0 ? k.data() : v.data()) + l * nblocks;
    return static_cast<uint16_t*>(b[t / block]) + (t % block) * H;
  }
  void fill() {
    for (int32_t l = 0; l < L; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (int64_t t = 0; t < T; ++t) {
          uint16_t* r = row(l, kind, t);
          for (int32_t c = 0; c < H; ++c) r[c] = kv_value(l, kind, t, c);
        }
  }
};

/** A contiguous [n][H] bf16 page as a kvxfer page layout. */
kvxfer_page_layout_t contiguous(void* const* block, int64_t n, int32_t H) {
  kvxfer_page_layout_t p{};
  p.blocks = block;
  p.num_blocks = 1;
  p.block_size = static_cast<int32_t>(std::max<int64_t>(1, n));
  p.row_stride = H;
  p.first_token = 0;
  p.num_tokens = n;
  p.num_channels = H;
  p.dtype = KVXFER_DTYPE_BF16;
  return p;
}

/** Compares the received KV with the codec's full-precision decode of the
 *  sender's pages (pages of page_tokens tokens from token 0, per layer and
 *  K/V, default codec config: what kvxfer_send used).  Returns a description
 *  of the first difference, or "" if every value matches. */
std::string verify(const Options& o, PagedKV& got) {
  const kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  const int32_t H = got.H;
  std::vector<uint16_t> src, dec;
  std::vector<uint8_t> a, r;
  for (int32_t l = 0; l < o.layers; ++l)
    for (int kind = 0; kind < 2; ++kind)
      for (int64_t t0 = 0; t0 < o.tokens; t0 += o.page_tokens) {
        const int64_t n = std::min<int64_t>(o.page_tokens, o.tokens - t0);
        src.resize(static_cast<size_t>(n) * H);
        dec.assign(static_cast<size_t>(n) * H, 0);
        for (int64_t t = 0; t < n; ++t)
          for (int32_t c = 0; c < H; ++c) src[t * H + c] = kv_value(l, kind, t0 + t, c);
        size_t acap = 0, rcap = 0, alen = 0, rlen = 0;
        if (kvxfer_page_max_size(&cfg, n, H, &acap, &rcap) != KVXFER_SUCCESS)
          return std::string("kvxfer_page_max_size: ") + kvxfer_get_last_error();
        a.resize(acap);
        r.resize(rcap);
        void* sb[1] = {src.data()};
        void* db[1] = {dec.data()};
        const kvxfer_page_layout_t sl = contiguous(sb, n, H), dl = contiguous(db, n, H);
        const kvxfer_page_id_t id{static_cast<uint32_t>(l),
                                  kind == 0 ? KVXFER_KV_KEY : KVXFER_KV_VALUE, t0, 0};
        if (kvxfer_page_encode(&cfg, &id, &sl, a.data(), acap, &alen, r.data(), rcap, &rlen) !=
                KVXFER_SUCCESS ||
            kvxfer_page_decode(a.data(), alen, r.data(), rlen, nullptr, &dl) != KVXFER_SUCCESS)
          return std::string("reference encode/decode: ") + kvxfer_get_last_error();
        for (int64_t t = 0; t < n; ++t)
          if (std::memcmp(got.row(l, kind, t0 + t), &dec[t * H], sizeof(uint16_t) * H) != 0) {
            char buf[128];
            std::snprintf(buf, sizeof(buf), "layer %d %s token %" PRId64 " differs", l,
                          kind == 0 ? "K" : "V", t0 + t);
            return buf;
          }
      }
  return "";
}

double ms(int64_t t_ns, int64_t base_ns) {
  return t_ns == 0 ? -1.0 : static_cast<double>(t_ns - base_ns) / 1e6;
}

kvxfer_comm_t init(const Options& o, const kvxfer_unique_id_t& id, int rank) {
  kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
  cfg.timeout_ms = o.timeout_ms;  // addresses: KVXFER_BIND_ADDR (bind_address NULL)
  kvxfer_comm_t comm = nullptr;
  if (kvxfer_comm_init(&comm, 2, id, rank, &cfg) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "netns_peer: rank %d: kvxfer_comm_init: %s\n", rank,
                 kvxfer_get_last_error());
    return nullptr;
  }
  return comm;
}

void print_info(const kvxfer_request_info_t& i) {
  const int64_t b = i.t_posted_ns;
  std::printf("result=%d\nstage=%d\nmode=%d\nnum_pages=%" PRId64 "\nkv_bytes=%" PRIu64
              "\nanchor_bytes=%" PRIu64 "\nresidual_bytes=%" PRIu64
              "\nt_handshake_ms=%.3f\nt_anchor_ready_ms=%.3f\nt_complete_ms=%.3f"
              "\nt_first_residual_ms=%.3f\n",
              i.result, i.stage, i.mode, i.num_pages, i.kv_bytes, i.anchor_wire_bytes,
              i.residual_wire_bytes, ms(i.t_handshake_ns, b), ms(i.t_anchor_ready_ns, b),
              ms(i.t_complete_ns, b), ms(i.t_first_residual_ns, b));
}

/** Per-class timeline of a request, relative to its t_posted. */
void print_arrivals(kvxfer_request_t req, int64_t base) {
  size_t n = 0;
  if (kvxfer_request_get_arrivals(req, nullptr, 0, &n) != KVXFER_SUCCESS) {
    std::printf("arrivals_error=%s\n", kvxfer_get_last_error());
    return;
  }
  std::vector<kvxfer_arrival_t> arr(n);
  size_t got = 0;
  kvxfer_request_get_arrivals(req, arr.data(), arr.size(), &got);
  arr.resize(std::min(got, n));
  int64_t anchor_first = 0, anchor_last = 0, res_first = 0, res_last = 0, res_half = 0;
  uint64_t a_bytes = 0, r_bytes = 0, r_after = 0;
  size_t na = 0, nr = 0;
  for (const auto& x : arr) {
    if (x.traffic_class == 0) {
      if (na++ == 0) anchor_first = x.t_ns;
      anchor_last = std::max(anchor_last, x.t_ns);
      a_bytes += x.bytes;
    } else {
      if (nr++ == 0) res_first = x.t_ns;
      res_last = std::max(res_last, x.t_ns);
      r_bytes += x.bytes;
    }
  }
  // When half of the residual bytes had landed, and how many landed after
  // the last anchor.
  uint64_t acc = 0;
  for (const auto& x : arr) {
    if (x.traffic_class != 1) continue;
    acc += x.bytes;
    if (res_half == 0 && 2 * acc >= r_bytes) res_half = x.t_ns;
    if (x.t_ns > anchor_last) r_after += x.bytes;
  }
  std::printf("arrivals=%zu\nanchor_sections=%zu\nresidual_sections=%zu\n", arr.size(), na, nr);
  std::printf("arr_anchor_bytes=%" PRIu64 "\narr_residual_bytes=%" PRIu64 "\n", a_bytes, r_bytes);
  std::printf("anchor_first_ms=%.3f\nanchor_last_ms=%.3f\n", ms(anchor_first, base),
              ms(anchor_last, base));
  std::printf("residual_first_ms=%.3f\nresidual_half_ms=%.3f\nresidual_last_ms=%.3f\n",
              ms(res_first, base), ms(res_half, base), ms(res_last, base));
  std::printf("residual_bytes_after_last_anchor=%" PRIu64 "\n", r_after);
}

int run_recv(const Options& o) {
  PagedKV dst(o, 32);  // a block size other than the sender's
  kvxfer_unique_id_t id{};
  if (kvxfer_get_unique_id(&id) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "netns_peer: kvxfer_get_unique_id: %s\n", kvxfer_get_last_error());
    return 1;
  }
  if (!write_file(o.id_file, &id, sizeof(id))) {
    std::fprintf(stderr, "netns_peer: cannot write %s: %s\n", o.id_file.c_str(),
                 std::strerror(errno));
    return 1;
  }
  kvxfer_comm_t comm = init(o, id, 0);
  if (comm == nullptr) return 1;
  kvxfer_request_t req = nullptr;
  if (kvxfer_recv(comm, 1, &dst.desc, nullptr, &req) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "netns_peer: kvxfer_recv: %s\n", kvxfer_get_last_error());
    kvxfer_comm_destroy(comm);
    return 1;
  }
  const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, o.wait_s * 1000);
  const std::string err = r == KVXFER_SUCCESS ? "" : kvxfer_get_last_error();
  kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
  kvxfer_request_get_info(req, &info);
  std::printf("role=recv\nwait=%d\n", r);
  if (!err.empty()) std::printf("error=%s\n", err.c_str());
  print_info(info);
  print_arrivals(req, info.t_posted_ns);
  std::string bad = "not checked";
  if (r == KVXFER_SUCCESS) bad = verify(o, dst);
  std::printf("verify=%s\n", bad.empty() ? "ok" : bad.c_str());
  std::fflush(stdout);
  // Let the sender see its confirmation before this side's links close.
  const bool peer_done = wait_for_file(o.id_file + ".done", r == KVXFER_SUCCESS ? o.wait_s : 2);
  std::printf("peer_done=%d\n", peer_done ? 1 : 0);
  if (r == KVXFER_IN_PROGRESS) kvxfer_comm_abort(comm);
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return r == KVXFER_SUCCESS && bad.empty() ? 0 : 1;
}

int run_send(const Options& o) {
  PagedKV src(o, 16);
  src.fill();  // before joining, so both sides post at about the same time
  if (!wait_for_file(o.id_file, o.wait_s)) {
    std::fprintf(stderr, "netns_peer: %s did not appear within %d s\n", o.id_file.c_str(),
                 o.wait_s);
    return 1;
  }
  kvxfer_unique_id_t id{};
  FILE* f = std::fopen(o.id_file.c_str(), "rb");
  const bool ok = f != nullptr && std::fread(&id, 1, sizeof(id), f) == sizeof(id);
  if (f != nullptr) std::fclose(f);
  if (!ok) {
    std::fprintf(stderr, "netns_peer: cannot read a unique id from %s\n", o.id_file.c_str());
    return 1;
  }
  kvxfer_comm_t comm = init(o, id, 1);
  if (comm == nullptr) return 1;
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.mode = KVXFER_MODE_PROGRESSIVE;
  rc.page_tokens = o.page_tokens;
  kvxfer_request_t req = nullptr;
  if (kvxfer_send(comm, 0, &src.desc, nullptr, &rc, &req) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "netns_peer: kvxfer_send: %s\n", kvxfer_get_last_error());
    kvxfer_comm_destroy(comm);
    return 1;
  }
  const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, o.wait_s * 1000);
  const std::string err = r == KVXFER_SUCCESS ? "" : kvxfer_get_last_error();
  write_file(o.id_file + ".done", "1", 1);
  kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
  kvxfer_request_get_info(req, &info);
  std::printf("role=send\nwait=%d\n", r);
  if (!err.empty()) std::printf("error=%s\n", err.c_str());
  print_info(info);
  print_arrivals(req, info.t_posted_ns);
  std::fflush(stdout);
  if (r == KVXFER_IN_PROGRESS) kvxfer_comm_abort(comm);
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return r == KVXFER_SUCCESS ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  parse(argc, argv, &o);
  return o.role == "recv" ? run_recv(o) : run_send(o);
}
