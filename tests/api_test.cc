// The public C API as a caller sees it: through libkvxfer.so, loaded with
// dlopen (KVXFER_LIB_PATH, set by tests/CMakeLists.txt), using nothing but
// include/kvxfer/kvxfer.h.  No internal header and no kvxfer_core symbol is
// used here, so this also checks what the shared library exports.
#include <dlfcn.h>
#include <elf.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kvxfer/kvxfer.h"

#ifndef KVXFER_LIB_PATH
#error "KVXFER_LIB_PATH must name libkvxfer.so (tests/CMakeLists.txt)"
#endif

namespace {

// ---------------------------------------------------------------------------
// The library, loaded once per process
// ---------------------------------------------------------------------------

struct Api {
  void* handle = nullptr;
  std::string error;
  decltype(&kvxfer_get_error_string) get_error_string = nullptr;
  decltype(&kvxfer_get_last_error) get_last_error = nullptr;
  decltype(&kvxfer_get_version) get_version = nullptr;
  decltype(&kvxfer_page_max_size) page_max_size = nullptr;
  decltype(&kvxfer_page_encode) page_encode = nullptr;
  decltype(&kvxfer_page_decode) page_decode = nullptr;
  decltype(&kvxfer_page_inspect) page_inspect = nullptr;
};

template <typename F>
void bind(Api* a, F* fn, const char* name) {
  *fn = reinterpret_cast<F>(dlsym(a->handle, name));
  if (*fn == nullptr) a->error += std::string(" missing ") + name;
}

const Api& api() {
  static const Api a = [] {
    Api r;
    r.handle = dlopen(KVXFER_LIB_PATH, RTLD_NOW | RTLD_LOCAL);
    if (r.handle == nullptr) {
      r.error = std::string("dlopen(") + KVXFER_LIB_PATH + "): " + dlerror();
      return r;
    }
    bind(&r, &r.get_error_string, "kvxfer_get_error_string");
    bind(&r, &r.get_last_error, "kvxfer_get_last_error");
    bind(&r, &r.get_version, "kvxfer_get_version");
    bind(&r, &r.page_max_size, "kvxfer_page_max_size");
    bind(&r, &r.page_encode, "kvxfer_page_encode");
    bind(&r, &r.page_decode, "kvxfer_page_decode");
    bind(&r, &r.page_inspect, "kvxfer_page_inspect");
    return r;
  }();
  return a;
}

#define REQUIRE_API() ASSERT_TRUE(api().handle != nullptr && api().error.empty()) << api().error

std::string last_error() { return api().get_last_error(); }
bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// ---------------------------------------------------------------------------
// Pages in a paged layout, without any kvxfer helper
// ---------------------------------------------------------------------------

uint16_t f32_to_bf16_trunc(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

size_t elem_size(kvxfer_dtype_t dt) { return dt == KVXFER_DTYPE_FP32 ? 4 : 2; }

struct Page {
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<void*> ptrs;
  kvxfer_page_layout_t layout{};

  Page(int64_t T, int32_t H, kvxfer_dtype_t dt, int32_t block = 16, int64_t first = 3,
       int64_t pad = 2) {
    layout.dtype = dt;
    layout.num_tokens = T;
    layout.num_channels = H;
    layout.block_size = block;
    layout.row_stride = H + pad;
    layout.first_token = first;
    const int64_t nb = (first + T + block - 1) / block;
    for (int64_t b = 0; b < nb; ++b)
      blocks.emplace_back(static_cast<size_t>(block * layout.row_stride) * elem_size(dt), 0x5A);
    for (auto& b : blocks) ptrs.push_back(b.data());
    layout.blocks = ptrs.data();
    layout.num_blocks = nb;
  }
  uint8_t* row(int64_t t) {
    const int64_t u = layout.first_token + t;
    return blocks[u / layout.block_size].data() +
           (u % layout.block_size) * layout.row_stride * elem_size(layout.dtype);
  }
  // Only FP32 and BF16 are needed here (BF16 by truncation of exactly representable values).
  void set(int64_t t, int32_t c, float v) {
    if (layout.dtype == KVXFER_DTYPE_FP32) {
      std::memcpy(row(t) + 4 * c, &v, 4);
    } else {
      const uint16_t h = f32_to_bf16_trunc(v);
      std::memcpy(row(t) + 2 * c, &h, 2);
    }
  }
  float get(int64_t t, int32_t c) {
    if (layout.dtype == KVXFER_DTYPE_FP32) {
      float v;
      std::memcpy(&v, row(t) + 4 * c, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, row(t) + 2 * c, 2);
    return bf16_to_f32(h);
  }
  std::vector<uint8_t> bytes() {
    std::vector<uint8_t> out;
    for (int64_t t = 0; t < layout.num_tokens; ++t)
      out.insert(out.end(), row(t), row(t) + layout.num_channels * elem_size(layout.dtype));
    return out;
  }
};

// Values in [-1, 1] per channel (plus a per-channel offset), deterministic.
void fill(Page* p, uint32_t seed) {
  uint32_t s = seed;
  for (int64_t t = 0; t < p->layout.num_tokens; ++t)
    for (int32_t c = 0; c < p->layout.num_channels; ++c) {
      s = s * 1664525u + 1013904223u;
      const float u = static_cast<float>(s >> 9) / 8388608.0f * 2.0f - 1.0f;  // multiple of 2^-22
      p->set(t, c, 0.125f * static_cast<float>(c % 9) + u);
    }
}

kvxfer_codec_config_t default_config() {
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  return c;
}

const kvxfer_page_id_t kId{3, KVXFER_KV_VALUE, 1000, 42};

struct Sections {
  std::vector<uint8_t> anchor, residual;
  kvxfer_result_t rc = KVXFER_SUCCESS;
};

Sections encode(const kvxfer_codec_config_t& cfg, const Page& p, const kvxfer_page_id_t& id = kId) {
  Sections s;
  size_t amax = 0, rmax = 0;
  s.rc = api().page_max_size(&cfg, p.layout.num_tokens, p.layout.num_channels, &amax, &rmax);
  if (s.rc != KVXFER_SUCCESS) return s;
  s.anchor.assign(amax, 0xEE);
  s.residual.assign(rmax, 0xEE);
  size_t al = 1, rl = 1;
  s.rc = api().page_encode(&cfg, &id, &p.layout, s.anchor.data(), amax, &al, s.residual.data(),
                           rmax, &rl);
  s.anchor.resize(al);
  s.residual.resize(rl);
  return s;
}

// ---------------------------------------------------------------------------
// Exported symbols
// ---------------------------------------------------------------------------

// Defined global/weak symbols of the ELF dynamic symbol table (version
// definition symbols, which are absolute, are left out).
std::set<std::string> exported_symbols(const char* path, std::string* err) {
  std::ifstream f(path, std::ios::binary);
  const std::vector<char> img((std::istreambuf_iterator<char>(f)),
                              std::istreambuf_iterator<char>());
  std::set<std::string> out;
  Elf64_Ehdr eh;
  if (img.size() < sizeof(eh)) return *err = "file too short", out;
  std::memcpy(&eh, img.data(), sizeof(eh));
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64)
    return *err = "not a 64-bit ELF file", out;
  auto shdr = [&](size_t i, Elf64_Shdr* sh) {
    const size_t off = eh.e_shoff + i * eh.e_shentsize;
    if (off + sizeof(*sh) > img.size()) return false;
    std::memcpy(sh, img.data() + off, sizeof(*sh));
    return true;
  };
  bool found = false;
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    Elf64_Shdr sh, str;
    if (!shdr(i, &sh) || sh.sh_type != SHT_DYNSYM) continue;
    if (!shdr(sh.sh_link, &str) || sh.sh_entsize != sizeof(Elf64_Sym))
      return *err = "bad dynsym", out;
    found = true;
    for (size_t k = 1; k < sh.sh_size / sizeof(Elf64_Sym); ++k) {
      Elf64_Sym sym;
      if (sh.sh_offset + (k + 1) * sizeof(sym) > img.size())
        return *err = "dynsym out of range", out;
      std::memcpy(&sym, img.data() + sh.sh_offset + k * sizeof(sym), sizeof(sym));
      const int bind = ELF64_ST_BIND(sym.st_info);
      if (sym.st_shndx == SHN_UNDEF || sym.st_shndx == SHN_ABS ||
          (bind != STB_GLOBAL && bind != STB_WEAK))
        continue;
      if (str.sh_offset + sym.st_name >= img.size()) return *err = "name out of range", out;
      out.insert(std::string(img.data() + str.sh_offset + sym.st_name));
    }
  }
  if (!found) *err = "no .dynsym section";
  return out;
}

// Every function the public header declares: kvxfer_*( outside comments.
std::set<std::string> declared_functions() {
  std::string text;
  for (const char* h : {"kvxfer.h", "spec.h", "spectrum.h"}) {  // every public header
    std::ifstream f(std::string(KVXFER_TEST_DATA_DIR) + "/../../include/kvxfer/" + h);
    text.append(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  text = std::regex_replace(text, std::regex(R"(/\*[\s\S]*?\*/)"), " ");
  text = std::regex_replace(text, std::regex(R"(//[^\n]*)"), " ");
  // Function-pointer typedefs ("typedef kvxfer_result_t (*fn)(...)") declare no function.
  text = std::regex_replace(text, std::regex(R"(typedef[^;]*;)"), " ");
  std::set<std::string> out;
  const std::regex fn(R"(\b(kvxfer_[a-z0-9_]+)\s*\()");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), fn); it != std::sregex_iterator();
       ++it)
    out.insert((*it)[1]);
  return out;
}

TEST(CApi, ExportsExactlyThePublicFunctions) {
  REQUIRE_API();
  std::string err;
  const std::set<std::string> exported = exported_symbols(KVXFER_LIB_PATH, &err);
  ASSERT_TRUE(err.empty()) << err;
  const std::set<std::string> declared = declared_functions();
  // The codec API at least; the header may declare more as it grows.
  for (const char* f : {"kvxfer_get_error_string", "kvxfer_get_last_error", "kvxfer_get_version",
                        "kvxfer_page_max_size", "kvxfer_page_encode", "kvxfer_page_decode",
                        "kvxfer_page_inspect"}) {
    EXPECT_EQ(declared.count(f), 1u) << f << " not found in kvxfer.h";
    EXPECT_EQ(exported.count(f), 1u) << f << " not exported";
  }
  for (const auto& s : exported)
    EXPECT_EQ(declared.count(s), 1u) << "exported but not in a public header: " << s;
  for (const auto& s : declared)
    EXPECT_EQ(exported.count(s), 1u) << "declared in a public header but not exported: " << s;
}

TEST(CApi, InternalSymbolsAreHidden) {
  REQUIRE_API();
  // C++ internals of kvxfer_core (mangled names as GCC and clang spell them).
  for (const char* s :
       {"_ZN6kvxfer10last_errorEv", "_ZN6kvxfer11clear_errorEv",
        "_ZN6kvxfer9set_errorE15kvxfer_result_tPKcz", "_ZN6kvxfer6params8validateEv",
        "_ZN6kvxfer5codec13parse_sectionEPKvmPNS0_10PageHeaderE",
        "_ZN6kvxfer5codec12seal_sectionEPh"}) {
    dlerror();
    EXPECT_EQ(dlsym(api().handle, s), nullptr) << s << " is visible";
  }
  EXPECT_NE(dlsym(api().handle, "kvxfer_page_encode"), nullptr);
}

// ---------------------------------------------------------------------------
// Version, result codes, error text
// ---------------------------------------------------------------------------

TEST(CApi, VersionIsTheHeaders) {
  REQUIRE_API();
  int v = -1;
  ASSERT_EQ(api().get_version(&v), KVXFER_SUCCESS);
  EXPECT_EQ(v, KVXFER_VERSION_CODE);
  EXPECT_EQ(KVXFER_VERSION_CODE, KVXFER_MAJOR * 10000 + KVXFER_MINOR * 100 + KVXFER_PATCH);
  EXPECT_EQ(api().get_version(nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "version is NULL")) << last_error();
}

TEST(CApi, EveryResultHasADistinctString) {
  REQUIRE_API();
  const std::string unknown = api().get_error_string(static_cast<kvxfer_result_t>(-1000));
  EXPECT_FALSE(unknown.empty());
  std::set<std::string> seen;
  for (int r = KVXFER_RESULT_MIN; r <= KVXFER_IN_PROGRESS; ++r) {
    const char* s = api().get_error_string(static_cast<kvxfer_result_t>(r));
    ASSERT_NE(s, nullptr) << r;
    EXPECT_GT(std::strlen(s), 3u) << r;
    EXPECT_NE(s, unknown) << "code " << r << " has no string of its own";
    EXPECT_TRUE(seen.insert(s).second) << "duplicate string \"" << s << "\" for " << r;
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(KVXFER_IN_PROGRESS - KVXFER_RESULT_MIN + 1));
  EXPECT_STREQ(api().get_error_string(KVXFER_SUCCESS), "success");
  for (int r : {2, 100, KVXFER_RESULT_MIN - 1, std::numeric_limits<int>::min()})
    EXPECT_NE(api().get_error_string(static_cast<kvxfer_result_t>(r)), nullptr) << r;
}

TEST(CApi, LastErrorIsEmptyAfterSuccessAndDescriptiveAfterFailure) {
  REQUIRE_API();
  const uint8_t junk[100] = {'n', 'o', 't', ' ', 'a', ' ', 'p', 'a', 'g', 'e'};
  kvxfer_page_info_t info;
  EXPECT_EQ(api().page_inspect(junk, sizeof(junk), &info), KVXFER_ERR_CORRUPT);
  EXPECT_TRUE(contains(last_error(), "bad magic")) << last_error();
  int v;
  EXPECT_EQ(api().get_version(&v), KVXFER_SUCCESS);
  EXPECT_EQ(last_error(), "");
  EXPECT_EQ(api().page_inspect(junk, 10, &info), KVXFER_ERR_TRUNCATED);
  EXPECT_TRUE(contains(last_error(), "shorter than the 80-byte header")) << last_error();
  size_t a, r;
  const kvxfer_codec_config_t cfg = default_config();
  EXPECT_EQ(api().page_max_size(&cfg, 64, 128, &a, &r), KVXFER_SUCCESS);
  EXPECT_EQ(last_error(), "");
}

TEST(CApi, LastErrorIsPerThread) {
  REQUIRE_API();
  kvxfer_page_info_t info;
  EXPECT_EQ(api().page_inspect(nullptr, 0, &info), KVXFER_ERR_INVALID_ARGUMENT);
  const std::string mine = last_error();
  EXPECT_FALSE(mine.empty());
  std::string theirs = "unset";
  std::thread([&] { theirs = last_error(); }).join();
  EXPECT_EQ(theirs, "");
  std::thread([&] {
    int v;
    api().get_version(nullptr);
    theirs = last_error();
    api().get_version(&v);
  }).join();
  EXPECT_TRUE(contains(theirs, "version is NULL"));
  EXPECT_EQ(last_error(), mine);
}

// ---------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------

TEST(CApi, Bf16PassthroughRoundTripIsExact) {
  REQUIRE_API();
  Page src(37, 24, KVXFER_DTYPE_BF16);
  fill(&src, 1);
  kvxfer_codec_config_t cfg = default_config();
  cfg.codec = KVXFER_CODEC_BF16;
  const Sections s = encode(cfg, src);
  ASSERT_EQ(s.rc, KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(s.anchor.size(), 80u + 37u * 24u * 2u);
  EXPECT_EQ(s.residual.size(), 80u);
  Page out(37, 24, KVXFER_DTYPE_BF16, 5, 0, 0);
  ASSERT_EQ(api().page_decode(s.anchor.data(), s.anchor.size(), s.residual.data(),
                              s.residual.size(), &kId, &out.layout),
            KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(out.bytes(), src.bytes());
  Page out2(37, 24, KVXFER_DTYPE_BF16, 64, 10, 1);
  ASSERT_EQ(api().page_decode(s.anchor.data(), s.anchor.size(), nullptr, 0, nullptr, &out2.layout),
            KVXFER_SUCCESS);
  EXPECT_EQ(out2.bytes(), src.bytes());
}

TEST(CApi, LynxRoundTripIsProgressiveAndDeterministic) {
  REQUIRE_API();
  const int64_t T = 100;
  const int32_t H = 64;
  Page src(T, H, KVXFER_DTYPE_FP32);
  fill(&src, 2);
  kvxfer_codec_config_t cfg = default_config();
  cfg.alpha = 20.0f;  // not the default
  const Sections s = encode(cfg, src);
  ASSERT_EQ(s.rc, KVXFER_SUCCESS) << last_error();
  size_t amax, rmax;
  ASSERT_EQ(api().page_max_size(&cfg, T, H, &amax, &rmax), KVXFER_SUCCESS);
  EXPECT_LE(s.anchor.size(), amax);
  EXPECT_LE(s.residual.size(), rmax);
  // Encoding is deterministic.
  const Sections again = encode(cfg, src);
  EXPECT_EQ(again.anchor, s.anchor);
  EXPECT_EQ(again.residual, s.residual);

  kvxfer_page_info_t ai, ri;
  ASSERT_EQ(api().page_inspect(s.anchor.data(), s.anchor.size(), &ai), KVXFER_SUCCESS)
      << last_error();
  ASSERT_EQ(api().page_inspect(s.residual.data(), s.residual.size(), &ri), KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(ai.is_residual, 0);
  EXPECT_EQ(ri.is_residual, 1);
  for (const kvxfer_page_info_t* i : {&ai, &ri}) {
    EXPECT_EQ(i->codec, KVXFER_CODEC_LYNX);
    EXPECT_EQ(i->raw_fallback, 0);
    EXPECT_EQ(i->alpha, 20.0f);
    EXPECT_EQ(i->chunk_tokens, 32);
    EXPECT_EQ(i->anchor_bits, 4);
    EXPECT_EQ(i->residual_bits, 4);
    EXPECT_EQ(i->src_dtype, KVXFER_DTYPE_FP32);
    EXPECT_EQ(i->meta_fp32, 0);
    EXPECT_EQ(i->id.layer, kId.layer);
    EXPECT_EQ(i->id.kind, kId.kind);
    EXPECT_EQ(i->id.token_begin, kId.token_begin);
    EXPECT_EQ(i->id.stream_id, kId.stream_id);
    EXPECT_EQ(i->num_tokens, T);
    EXPECT_EQ(i->num_channels, H);
  }
  EXPECT_EQ(ai.section_bytes, s.anchor.size());
  EXPECT_EQ(ri.section_bytes, s.residual.size());

  Page anchor_only(T, H, KVXFER_DTYPE_FP32, 7, 0, 1), full(T, H, KVXFER_DTYPE_FP32, 16, 9, 0);
  ASSERT_EQ(
      api().page_decode(s.anchor.data(), s.anchor.size(), nullptr, 0, &kId, &anchor_only.layout),
      KVXFER_SUCCESS)
      << last_error();
  ASSERT_EQ(api().page_decode(s.anchor.data(), s.anchor.size(), s.residual.data(),
                              s.residual.size(), &kId, &full.layout),
            KVXFER_SUCCESS)
      << last_error();
  double err_anchor = 0, err_full = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c) {
      err_anchor = std::max(err_anchor, std::fabs(double(src.get(t, c)) - anchor_only.get(t, c)));
      err_full = std::max(err_full, std::fabs(double(src.get(t, c)) - full.get(t, c)));
    }
  // Values span about [-1, 1] per chunk and channel: an 8-bit alpha-law code
  // is within ~0.013 of it, a 4-bit anchor within ~0.3.
  EXPECT_LT(err_full, 0.02);
  EXPECT_LT(err_anchor, 0.35);
  EXPECT_GT(err_anchor, 4 * err_full) << "the residual must refine the anchor";
  // Decoding is deterministic too.
  Page full2(T, H, KVXFER_DTYPE_FP32);
  ASSERT_EQ(api().page_decode(s.anchor.data(), s.anchor.size(), s.residual.data(),
                              s.residual.size(), nullptr, &full2.layout),
            KVXFER_SUCCESS);
  EXPECT_EQ(full2.bytes(), full.bytes());
}

TEST(CApi, NonFiniteInputFailsOrIsStoredRawLosslessly) {
  REQUIRE_API();
  Page src(20, 8, KVXFER_DTYPE_FP32);
  fill(&src, 3);
  src.set(13, 5, std::numeric_limits<float>::quiet_NaN());
  src.set(2, 1, -std::numeric_limits<float>::infinity());
  kvxfer_codec_config_t cfg = default_config();
  const Sections bad = encode(cfg, src);
  EXPECT_EQ(bad.rc, KVXFER_ERR_NONFINITE);
  EXPECT_TRUE(contains(last_error(), "Inf at layer 3 V, token 1002, channel 1")) << last_error();
  EXPECT_TRUE(bad.anchor.empty() && bad.residual.empty()) << "lengths must be 0 on failure";
  cfg.nonfinite = KVXFER_NONFINITE_RAW;
  const Sections raw = encode(cfg, src);
  ASSERT_EQ(raw.rc, KVXFER_SUCCESS) << last_error();
  kvxfer_page_info_t info;
  ASSERT_EQ(api().page_inspect(raw.anchor.data(), raw.anchor.size(), &info), KVXFER_SUCCESS);
  EXPECT_EQ(info.raw_fallback, 1);
  Page out(20, 8, KVXFER_DTYPE_FP32, 3, 1, 0);
  ASSERT_EQ(api().page_decode(raw.anchor.data(), raw.anchor.size(), raw.residual.data(),
                              raw.residual.size(), nullptr, &out.layout),
            KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(out.bytes(), src.bytes());
  // Buffers of the raw page's own sizes hold it, though its codes would not
  // fit them (a larger residual); a finite page does not fit them, and the
  // error gives its codes' sizes.
  std::vector<uint8_t> a(raw.anchor.size()), r(raw.residual.size());
  size_t al = 0, rl = 0;
  ASSERT_EQ(
      api().page_encode(&cfg, &kId, &src.layout, a.data(), a.size(), &al, r.data(), r.size(), &rl),
      KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(a, raw.anchor);
  EXPECT_EQ(std::vector<uint8_t>(r.begin(), r.begin() + static_cast<std::ptrdiff_t>(rl)),
            raw.residual);
  Page finite(20, 8, KVXFER_DTYPE_FP32);
  fill(&finite, 3);
  const Sections codes = encode(cfg, finite);
  ASSERT_EQ(codes.rc, KVXFER_SUCCESS);
  ASSERT_GT(codes.residual.size(), r.size());
  EXPECT_EQ(api().page_encode(&cfg, &kId, &finite.layout, a.data(), a.size(), &al, r.data(),
                              r.size(), &rl),
            KVXFER_ERR_BUFFER_TOO_SMALL);
  EXPECT_TRUE(contains(last_error(), "residual bytes")) << last_error();
  EXPECT_TRUE(contains(last_error(), std::to_string(codes.residual.size()) + " residual bytes"))
      << last_error();
}

TEST(CApi, SmallOutputBuffersAreRefused) {
  REQUIRE_API();
  Page src(40, 16, KVXFER_DTYPE_BF16);
  fill(&src, 4);
  const kvxfer_codec_config_t cfg = default_config();
  const Sections ok = encode(cfg, src);
  ASSERT_EQ(ok.rc, KVXFER_SUCCESS);
  std::vector<uint8_t> a(ok.anchor.size()), r(ok.residual.size());
  size_t al = 7, rl = 7;
  EXPECT_EQ(api().page_encode(&cfg, &kId, &src.layout, a.data(), a.size() - 1, &al, r.data(),
                              r.size(), &rl),
            KVXFER_ERR_BUFFER_TOO_SMALL);
  EXPECT_TRUE(contains(last_error(), "kvxfer_page_max_size")) << last_error();
  EXPECT_EQ(al, 0u);
  EXPECT_EQ(rl, 0u);
  EXPECT_EQ(api().page_encode(&cfg, &kId, &src.layout, a.data(), a.size(), &al, r.data(),
                              r.size() - 1, &rl),
            KVXFER_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(
      api().page_encode(&cfg, &kId, &src.layout, a.data(), a.size(), &al, r.data(), r.size(), &rl),
      KVXFER_SUCCESS);
  EXPECT_EQ(a, ok.anchor);
}

// Buffers that share bytes: encode would write over its own output or its
// input, decode over the sections it reads.  Refused at the call, nothing
// written; a buffer in the gap between two strided rows meets no row and is
// accepted.
TEST(CApi, OverlappingBuffersAreRefused) {
  REQUIRE_API();
  Page src(40, 16, KVXFER_DTYPE_BF16);
  fill(&src, 6);
  const kvxfer_codec_config_t cfg = default_config();
  const Sections ok = encode(cfg, src);
  ASSERT_EQ(ok.rc, KVXFER_SUCCESS);
  const std::vector<uint8_t> before = src.bytes();
  // The residual 100 bytes into the anchor's buffer.
  std::vector<uint8_t> one(ok.anchor.size() + ok.residual.size() + 100);
  size_t al = 7, rl = 7;
  EXPECT_EQ(api().page_encode(&cfg, &kId, &src.layout, one.data(), one.size(), &al,
                              one.data() + 100, one.size() - 100, &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "the anchor buffer")) << last_error();
  EXPECT_TRUE(contains(last_error(), "overlap")) << last_error();
  EXPECT_EQ(al, 0u);
  EXPECT_EQ(rl, 0u);
  // The anchor buffer on the page's second block (source rows).
  std::vector<uint8_t> r(ok.residual.size());
  EXPECT_EQ(api().page_encode(&cfg, &kId, &src.layout, src.blocks[1].data(), ok.anchor.size(), &al,
                              r.data(), r.size(), &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "overlaps source block 1")) << last_error();
  EXPECT_EQ(src.bytes(), before);
  // Decode into a destination whose block holds the anchor section.
  Page dst(40, 16, KVXFER_DTYPE_BF16);
  std::vector<uint8_t> sections = ok.anchor;
  dst.blocks[2].assign(dst.blocks[2].size() + sections.size(), 0x5A);
  dst.ptrs[2] = dst.blocks[2].data();
  std::memcpy(dst.blocks[2].data(), sections.data(), sections.size());
  EXPECT_EQ(
      api().page_decode(dst.blocks[2].data(), sections.size(), nullptr, 0, nullptr, &dst.layout),
      KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "overlaps destination block 2")) << last_error();
  EXPECT_EQ(0, std::memcmp(dst.blocks[2].data(), sections.data(), sections.size()));
  // Two rows 64 KiB apart: an anchor buffer between them is no row's.
  Page wide(2, 16, KVXFER_DTYPE_BF16, 16, 0, 32768 - 16);
  fill(&wide, 9);
  std::vector<uint8_t> ra(ok.residual.size());
  uint8_t* gap = wide.blocks[0].data() + 16 * 2;  // just past row 0's 32 bytes
  EXPECT_EQ(api().page_encode(&cfg, &kId, &wide.layout, gap, 4096, &al, ra.data(), ra.size(), &rl),
            KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(
      api().page_encode(&cfg, &kId, &wide.layout, gap - 1, 4096, &al, ra.data(), ra.size(), &rl),
      KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "overlaps source block 0")) << last_error();
  // A block list that an output or the destination's rows cover: encode
  // would overwrite the caller's pointers, decode would follow the pointers
  // it overwrote.
  std::vector<uint8_t> lists(ok.anchor.size() + 64);
  std::memcpy(lists.data() + 8, src.ptrs.data(), src.ptrs.size() * sizeof(void*));
  Page moved = src;
  moved.layout.blocks = reinterpret_cast<void* const*>(lists.data() + 8);
  EXPECT_EQ(api().page_encode(&cfg, &kId, &moved.layout, lists.data(), lists.size(), &al, r.data(),
                              r.size(), &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "overlaps the source's block list")) << last_error();
  Page dst2(40, 16, KVXFER_DTYPE_BF16);
  uint8_t* in_row = dst2.row(15);  // block 1's row 2 (first_token 3): 72 bytes in, aligned
  std::memcpy(in_row, dst2.ptrs.data(), dst2.ptrs.size() * sizeof(void*));
  dst2.layout.blocks = reinterpret_cast<void* const*>(in_row);
  const std::vector<uint8_t> dst_before = dst2.bytes();
  EXPECT_EQ(api().page_decode(ok.anchor.data(), ok.anchor.size(), ok.residual.data(),
                              ok.residual.size(), nullptr, &dst2.layout),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "block list")) << last_error();
  EXPECT_TRUE(contains(last_error(), "lies in destination block 1")) << last_error();
  EXPECT_EQ(dst2.bytes(), dst_before);
}

// The expected page id of a decode is checked as encode checks a page id.
TEST(CApi, AnExpectedIdWithABadKindIsRefused) {
  REQUIRE_API();
  Page src(40, 16, KVXFER_DTYPE_BF16);
  fill(&src, 6);
  const Sections ok = encode(default_config(), src);
  ASSERT_EQ(ok.rc, KVXFER_SUCCESS);
  Page dst(40, 16, KVXFER_DTYPE_BF16);
  const std::vector<uint8_t> before = dst.bytes();
  for (int32_t kind : {257, 256, -1}) {
    kvxfer_page_id_t expect = kId;  // a V page: 257 would read as V in a byte
    std::memcpy(&expect.kind, &kind, sizeof kind);
    EXPECT_EQ(api().page_decode(ok.anchor.data(), ok.anchor.size(), ok.residual.data(),
                                ok.residual.size(), &expect, &dst.layout),
              KVXFER_ERR_INVALID_ARGUMENT)
        << kind;
    EXPECT_TRUE(contains(last_error(), "expected page id: bad K/V kind " + std::to_string(kind)))
        << last_error();
  }
  EXPECT_EQ(dst.bytes(), before);
}

// ---------------------------------------------------------------------------
// Bad configs, NULL pointers, bad layouts: INVALID_ARGUMENT, never a crash
// ---------------------------------------------------------------------------

TEST(CApi, ConfigWithWrongSizeMagicOrVersionIsRejected) {
  REQUIRE_API();
  Page src(8, 4, KVXFER_DTYPE_FP32);
  fill(&src, 5);
  struct Case {
    const char* name;
    void (*edit)(kvxfer_codec_config_t*);
    const char* message;
  } const cases[] = {
      {"size-1", [](kvxfer_codec_config_t* c) { c->size -= 1; }, "KVXFER_CODEC_CONFIG_INITIALIZER"},
      {"size0", [](kvxfer_codec_config_t* c) { c->size = 0; }, "KVXFER_CODEC_CONFIG_INITIALIZER"},
      {"size+8", [](kvxfer_codec_config_t* c) { c->size += 8; },
       "codec config has size 56, larger than the 48 bytes of this library's kvxfer.h"},
      {"size-4", [](kvxfer_codec_config_t* c) { c->size -= 4; },
       "size 44, magic 0x6b767866): the size must be 40 to 48, a multiple of 8"},
      {"size32", [](kvxfer_codec_config_t* c) { c->size = 32; }, "the size must be 40 to 48"},
      {"magic", [](kvxfer_codec_config_t* c) { c->magic = 0x6b767867u; }, "magic 0x6b767867"},
      {"zeroed", [](kvxfer_codec_config_t* c) { std::memset(c, 0, sizeof(*c)); },
       "KVXFER_CODEC_CONFIG_INITIALIZER"},
      {"major", [](kvxfer_codec_config_t* c) { c->version = KVXFER_VERSION_CODE + 10000; },
       "header version"},
      {"minor", [](kvxfer_codec_config_t* c) { c->version = KVXFER_VERSION_CODE + 100; },
       "header version"},
      {"codec", [](kvxfer_codec_config_t* c) { c->codec = static_cast<kvxfer_codec_t>(9); },
       "unknown codec 9"},
      {"chunk", [](kvxfer_codec_config_t* c) { c->chunk_tokens = 48; }, "chunk_tokens 48"},
      {"anchor_bits", [](kvxfer_codec_config_t* c) { c->anchor_bits = 7; }, "anchor_bits"},
      {"alpha_nan", [](kvxfer_codec_config_t* c) { c->alpha = std::nanf(""); }, "alpha"},
      {"alpha_big", [](kvxfer_codec_config_t* c) { c->alpha = 1000.5f; }, "alpha"},
      {"int4_bits",
       [](kvxfer_codec_config_t* c) {
         c->codec = KVXFER_CODEC_INT4;
         c->anchor_bits = 3;
       },
       "anchor_bits"},
      {"nonfinite",
       [](kvxfer_codec_config_t* c) { c->nonfinite = static_cast<kvxfer_nonfinite_policy_t>(2); },
       "nonfinite policy 2"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    kvxfer_codec_config_t cfg = default_config();
    k.edit(&cfg);
    size_t a = 1, r = 1;
    EXPECT_EQ(api().page_max_size(&cfg, 8, 4, &a, &r), KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(last_error(), k.message)) << last_error();
    std::vector<uint8_t> ab(4096), rb(4096);
    EXPECT_EQ(api().page_encode(&cfg, &kId, &src.layout, ab.data(), ab.size(), &a, rb.data(),
                                rb.size(), &r),
              KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(last_error(), k.message)) << last_error();
  }
  // A newer patch level of the same minor version is compatible.
  kvxfer_codec_config_t patch = default_config();
  patch.version = KVXFER_VERSION_CODE + 1;
  size_t a, r;
  EXPECT_EQ(api().page_max_size(&patch, 8, 4, &a, &r), KVXFER_SUCCESS) << last_error();
}

// A codec config from a kvxfer.h without value_groups (size 40, not 48) is
// accepted, and the library uses value_groups' default, CHANNEL, whatever
// lies in the caller's memory past `size`: its V page is byte for byte the
// one a whole config with CHANNEL gives, not the one TOKEN gives.
TEST(CApi, OlderSmallerCodecConfigTakesTheDefaults) {
  REQUIRE_API();
  static_assert(sizeof(kvxfer_codec_config_t) == 48, "the layout this test knows");
  Page src(40, 16, KVXFER_DTYPE_BF16);
  fill(&src, 7);
  const kvxfer_page_id_t id{1, KVXFER_KV_VALUE, 0, 9};  // token 0: sink rows
  kvxfer_codec_config_t channel = default_config();
  channel.sink_tokens = 3;  // a field the older layout has: the caller's value is used
  kvxfer_codec_config_t token = channel;
  token.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
  const Sections want = encode(channel, src, id), other = encode(token, src, id);
  ASSERT_EQ(want.rc, KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(other.rc, KVXFER_SUCCESS) << last_error();
  ASSERT_NE(want.anchor, other.anchor);  // value_groups shows in the bytes

  kvxfer_codec_config_t older = token;  // TOKEN sits past the older size
  older.size = offsetof(kvxfer_codec_config_t, value_groups);
  ASSERT_EQ(older.size, 40u);
  const Sections got = encode(older, src, id);
  ASSERT_EQ(got.rc, KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(got.anchor, want.anchor);
  EXPECT_EQ(got.residual, want.residual);
  kvxfer_codec_config_t no_sinks = channel;
  no_sinks.sink_tokens = 0;
  EXPECT_NE(got.anchor, encode(no_sinks, src, id).anchor);  // sink_tokens 3 was read
  size_t a_old = 0, r_old = 0, a_ch = 0, r_ch = 0;
  ASSERT_EQ(api().page_max_size(&older, 40, 16, &a_old, &r_old), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(api().page_max_size(&channel, 40, 16, &a_ch, &r_ch), KVXFER_SUCCESS);
  EXPECT_EQ(a_old, a_ch);
  EXPECT_EQ(r_old, r_ch);
}

// kvxfer_page_max_size of a shape no page can have: INVALID_ARGUMENT naming
// the field, the outputs untouched; the same config then sizes a page.
TEST(CApi, PageMaxSizeRefusesABadShape) {
  REQUIRE_API();
  const kvxfer_codec_config_t cfg = default_config();
  struct Case {
    int64_t tokens;
    int32_t channels;
    const char* message;
  } const cases[] = {
      {-1, 16, "num_tokens -1 outside [0, 2^32]"},
      {(int64_t{1} << 32) + 1, 16, "num_tokens 4294967297 outside [0, 2^32]"},
      {8, 0, "num_channels 0 outside [1, 1048576]"},
      {8, -4, "num_channels -4 outside [1, 1048576]"},
      {8, 1048577, "num_channels 1048577 outside [1, 1048576]"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.message);
    size_t a = 7, r = 7;
    EXPECT_EQ(api().page_max_size(&cfg, k.tokens, k.channels, &a, &r), KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(last_error(), k.message)) << last_error();
    EXPECT_EQ(a, 7u);
    EXPECT_EQ(r, 7u);
  }
  // The limits themselves are shapes, and the config still works.
  size_t a = 0, r = 0;
  EXPECT_EQ(api().page_max_size(&cfg, 0, 1048576, &a, &r), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(api().page_max_size(&cfg, 8, 16, &a, &r), KVXFER_SUCCESS) << last_error();
  EXPECT_TRUE(last_error().empty());
  Page src(8, 16, KVXFER_DTYPE_BF16);
  fill(&src, 3);
  const Sections s = encode(cfg, src);
  ASSERT_EQ(s.rc, KVXFER_SUCCESS);
  EXPECT_LE(s.anchor.size(), a);
  EXPECT_LE(s.residual.size(), r);
}

TEST(CApi, NullPointersAreInvalidArguments) {
  REQUIRE_API();
  Page src(8, 4, KVXFER_DTYPE_FP32);
  fill(&src, 6);
  const kvxfer_codec_config_t cfg = default_config();
  const Sections s = encode(cfg, src);
  ASSERT_EQ(s.rc, KVXFER_SUCCESS);
  std::vector<uint8_t> ab(4096), rb(4096);
  size_t al, rl;
  kvxfer_page_info_t info;
  const auto& A = api();
  auto expect_invalid = [&](kvxfer_result_t r, const char* what) {
    EXPECT_EQ(r, KVXFER_ERR_INVALID_ARGUMENT) << what << ": " << last_error();
    EXPECT_FALSE(last_error().empty()) << what;
  };
  expect_invalid(A.get_version(nullptr), "get_version");
  expect_invalid(A.page_max_size(nullptr, 8, 4, &al, &rl), "max_size config");
  expect_invalid(A.page_max_size(&cfg, 8, 4, nullptr, &rl), "max_size anchor");
  expect_invalid(A.page_max_size(&cfg, 8, 4, &al, nullptr), "max_size residual");
  expect_invalid(
      A.page_encode(nullptr, &kId, &src.layout, ab.data(), 4096, &al, rb.data(), 4096, &rl),
      "enc cfg");
  expect_invalid(
      A.page_encode(&cfg, nullptr, &src.layout, ab.data(), 4096, &al, rb.data(), 4096, &rl),
      "enc id");
  expect_invalid(A.page_encode(&cfg, &kId, nullptr, ab.data(), 4096, &al, rb.data(), 4096, &rl),
                 "enc src");
  expect_invalid(A.page_encode(&cfg, &kId, &src.layout, nullptr, 4096, &al, rb.data(), 4096, &rl),
                 "enc anchor");
  expect_invalid(
      A.page_encode(&cfg, &kId, &src.layout, ab.data(), 4096, nullptr, rb.data(), 4096, &rl),
      "enc alen");
  expect_invalid(A.page_encode(&cfg, &kId, &src.layout, ab.data(), 4096, &al, nullptr, 4096, &rl),
                 "enc residual");
  expect_invalid(
      A.page_encode(&cfg, &kId, &src.layout, ab.data(), 4096, &al, rb.data(), 4096, nullptr),
      "enc rlen");
  Page dst(8, 4, KVXFER_DTYPE_FP32);
  expect_invalid(A.page_decode(nullptr, s.anchor.size(), nullptr, 0, nullptr, &dst.layout),
                 "dec anchor");
  expect_invalid(A.page_decode(s.anchor.data(), s.anchor.size(), nullptr, 0, nullptr, nullptr),
                 "dec dst");
  expect_invalid(A.page_decode(s.anchor.data(), s.anchor.size(), nullptr, 5, nullptr, &dst.layout),
                 "dec res len");
  expect_invalid(A.page_inspect(nullptr, 100, &info), "inspect section");
  expect_invalid(A.page_inspect(s.anchor.data(), s.anchor.size(), nullptr), "inspect info");
  // NULL block list or NULL blocks in a layout.
  kvxfer_page_layout_t l = src.layout;
  l.blocks = nullptr;
  expect_invalid(A.page_encode(&cfg, &kId, &l, ab.data(), 4096, &al, rb.data(), 4096, &rl),
                 "enc NULL blocks");
  expect_invalid(A.page_decode(s.anchor.data(), s.anchor.size(), nullptr, 0, nullptr, &l),
                 "dec NULL blocks");
  std::vector<void*> holes(src.ptrs);
  holes.back() = nullptr;
  l.blocks = holes.data();
  expect_invalid(A.page_encode(&cfg, &kId, &l, ab.data(), 4096, &al, rb.data(), 4096, &rl),
                 "enc NULL block");
  EXPECT_TRUE(contains(last_error(), "source block")) << last_error();
  expect_invalid(A.page_decode(s.anchor.data(), s.anchor.size(), nullptr, 0, nullptr, &l),
                 "dec NULL block");
  EXPECT_TRUE(contains(last_error(), "destination block")) << last_error();
}

TEST(CApi, BadLayoutsAreInvalidArguments) {
  REQUIRE_API();
  Page src(8, 4, KVXFER_DTYPE_FP32);
  fill(&src, 7);
  const kvxfer_codec_config_t cfg = default_config();
  std::vector<uint8_t> ab(4096), rb(4096);
  size_t al, rl;
  struct Case {
    const char* name;
    void (*edit)(kvxfer_page_layout_t*);
    const char* message;
  } const cases[] = {
      {"dtype", [](kvxfer_page_layout_t* l) { l->dtype = static_cast<kvxfer_dtype_t>(3); },
       "dtype 3"},
      {"channels0", [](kvxfer_page_layout_t* l) { l->num_channels = 0; }, "num_channels 0"},
      {"channels-", [](kvxfer_page_layout_t* l) { l->num_channels = -4; }, "num_channels -4"},
      {"tokens-", [](kvxfer_page_layout_t* l) { l->num_tokens = -1; }, "num_tokens -1"},
      {"tokens-big", [](kvxfer_page_layout_t* l) { l->num_tokens = (int64_t{1} << 32) + 1; },
       "num_tokens"},
      {"block0", [](kvxfer_page_layout_t* l) { l->block_size = 0; }, "block_size 0"},
      {"block-", [](kvxfer_page_layout_t* l) { l->block_size = -16; }, "block_size -16"},
      {"stride", [](kvxfer_page_layout_t* l) { l->row_stride = 3; }, "row_stride 3"},
      {"first-", [](kvxfer_page_layout_t* l) { l->first_token = -1; }, "first_token -1"},
      {"blocks", [](kvxfer_page_layout_t* l) { l->num_blocks = 0; }, "num_blocks is 0"},
      {"blocks-", [](kvxfer_page_layout_t* l) { l->num_blocks = -1; }, "num_blocks is -1"},
  };
  const Sections s = encode(cfg, src);
  ASSERT_EQ(s.rc, KVXFER_SUCCESS);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    kvxfer_page_layout_t l = src.layout;
    k.edit(&l);
    EXPECT_EQ(
        api().page_encode(&cfg, &kId, &l, ab.data(), ab.size(), &al, rb.data(), rb.size(), &rl),
        KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(last_error(), "source")) << last_error();
    EXPECT_TRUE(contains(last_error(), k.message)) << last_error();
    EXPECT_EQ(api().page_decode(s.anchor.data(), s.anchor.size(), nullptr, 0, nullptr, &l),
              KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(last_error(), "destination")) << last_error();
  }
}

// Layouts whose token range or row offsets overflow int64: validation must
// refuse them before any row address is formed (validate_layout once computed
// first_token + num_tokens - 1 with signed overflow, and
// (u % block_size) * row_stride * elem could overflow for a huge row_stride).
// Run in a child so a crash is a failure, not the end of the suite.
void encode_overflowing_layout(int which) {
  std::vector<uint8_t> blk(4096);
  void* b[2] = {blk.data(), blk.data()};
  kvxfer_page_layout_t l{b, 2, 1, 4, std::numeric_limits<int64_t>::max(), 2, 4, KVXFER_DTYPE_FP32};
  if (which == 1) {
    l.first_token = 0;
    l.block_size = 2;
    l.row_stride = std::numeric_limits<int64_t>::max() / 2;
  }
  const kvxfer_codec_config_t cfg = default_config();
  std::vector<uint8_t> ab(4096), rb(4096);
  size_t al, rl;
  const kvxfer_result_t r =
      api().page_encode(&cfg, &kId, &l, ab.data(), ab.size(), &al, rb.data(), rb.size(), &rl);
  std::fprintf(stderr, "result %d: %s\n", static_cast<int>(r), api().get_last_error());
  std::exit(r == KVXFER_ERR_INVALID_ARGUMENT ? 0 : 1);
}

TEST(CApiDeathTest, LayoutWhoseTokenRangeOverflowsIsRejected) {
  REQUIRE_API();
  EXPECT_EXIT(encode_overflowing_layout(0), ::testing::ExitedWithCode(0), "result -1");
}
TEST(CApiDeathTest, LayoutWhoseRowOffsetOverflowsIsRejected) {
  REQUIRE_API();
  EXPECT_EXIT(encode_overflowing_layout(1), ::testing::ExitedWithCode(0), "result -1");
}

// ---------------------------------------------------------------------------
// KVXFER_* environment: read once per process, so each case runs in a child
// (gtest re-executes this binary for just this test, then runs the statement).
// ---------------------------------------------------------------------------

// Sets `var`, then checks that every call either fails with INVALID_ARGUMENT
// naming the variable (bad == true) or succeeds.  Exits 0 and prints
// "env check passed" when it holds.
void check_env_in_child(const char* var, const char* value, bool bad) {
  setenv(var, value, 1);
  const Api& A = api();  // first use in this process
  if (A.handle == nullptr || !A.error.empty()) {
    std::fprintf(stderr, "cannot load the library: %s\n", A.error.c_str());
    std::exit(2);
  }
  int failures = 0;
  auto check = [&](kvxfer_result_t r, const char* call) {
    const std::string msg = A.get_last_error();
    const bool ok =
        bad ? r == KVXFER_ERR_INVALID_ARGUMENT && contains(msg, var) && contains(msg, value)
            : r == KVXFER_SUCCESS && msg.empty();
    if (!ok) {
      std::fprintf(stderr, "%s with %s=%s: result %d, message \"%s\"\n", call, var, value,
                   static_cast<int>(r), msg.c_str());
      ++failures;
    }
  };
  int v;
  check(A.get_version(&v), "kvxfer_get_version");
  Page src(20, 8, KVXFER_DTYPE_FP32);
  fill(&src, 8);
  const kvxfer_codec_config_t cfg = default_config();
  size_t amax = 0, rmax = 0;
  check(A.page_max_size(&cfg, 20, 8, &amax, &rmax), "kvxfer_page_max_size");
  std::vector<uint8_t> ab(4096), rb(4096);
  size_t al = 99, rl = 99;
  check(
      A.page_encode(&cfg, &kId, &src.layout, ab.data(), ab.size(), &al, rb.data(), rb.size(), &rl),
      "kvxfer_page_encode");
  if (bad && (al != 0 || rl != 0)) {  // kvxfer.h: on failure both lengths are 0
    std::fprintf(stderr, "kvxfer_page_encode left lengths %zu, %zu\n", al, rl);
    ++failures;
  }
  Page dst(20, 8, KVXFER_DTYPE_FP32);
  if (bad) {
    // Sections from a process without the bad variable would do as well;
    // a failed encode leaves none, so decode/inspect see a NULL section.
    check(A.page_decode(ab.data(), 0, nullptr, 0, nullptr, &dst.layout), "kvxfer_page_decode");
    kvxfer_page_info_t info;
    check(A.page_inspect(ab.data(), 0, &info), "kvxfer_page_inspect");
  } else {
    check(A.page_decode(ab.data(), al, rb.data(), rl, &kId, &dst.layout), "kvxfer_page_decode");
    kvxfer_page_info_t info;
    check(A.page_inspect(ab.data(), al, &info), "kvxfer_page_inspect");
  }
  if (failures == 0) std::fprintf(stderr, "env check passed\n");
  std::exit(failures == 0 ? 0 : 1);
}

class CApiEnvDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef GTEST_FLAG_SET
    GTEST_FLAG_SET(death_test_style, "threadsafe");
#else
    ::testing::FLAGS_gtest_death_test_style = "threadsafe";
#endif
  }
};

TEST_F(CApiEnvDeathTest, MalformedCodecThreadsFailsEveryCall) {
  EXPECT_EXIT(check_env_in_child("KVXFER_CODEC_THREADS", "abc", true), ::testing::ExitedWithCode(0),
              "env check passed");
}
TEST_F(CApiEnvDeathTest, OutOfRangeCodecThreadsFailsEveryCall) {
  EXPECT_EXIT(check_env_in_child("KVXFER_CODEC_THREADS", "5000", true),
              ::testing::ExitedWithCode(0), "env check passed");
}
TEST_F(CApiEnvDeathTest, BogusCodecImplFailsEveryCall) {
  EXPECT_EXIT(check_env_in_child("KVXFER_CODEC_IMPL", "bogus", true), ::testing::ExitedWithCode(0),
              "env check passed");
}
TEST_F(CApiEnvDeathTest, ValidCodecImplAndThreadsWork) {
  EXPECT_EXIT(check_env_in_child("KVXFER_CODEC_IMPL", "reference", false),
              ::testing::ExitedWithCode(0), "env check passed");
  EXPECT_EXIT(check_env_in_child("KVXFER_CODEC_THREADS", "2", false), ::testing::ExitedWithCode(0),
              "env check passed");
}

}  // namespace
