// Tests of src/common: the KVXFER_* parameter parsers, the log subsystem
// parser, the per-thread error text, the error strings, and (in child
// processes, since parameters are read once per process) how malformed
// environment variables fail API calls and what a log line looks like.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "codec/kv_desc.h"
#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "common/struct_abi.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer {
namespace {

constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// ---------------------------------------------------------------------------
// params::parse_int
// ---------------------------------------------------------------------------

bool ParseInt(const char* text, int64_t lo, int64_t hi, int64_t* out, std::string* why = nullptr) {
  std::string w;
  bool ok = params::parse_int(text, lo, hi, out, &w);
  if (why != nullptr) *why = w;
  if (!ok) {
    EXPECT_FALSE(w.empty()) << "no reason given for rejecting '" << text << "'";
  }
  return ok;
}

// A repeated event is logged at most once a period, with the count of
// events since the last line logged.
TEST(LogThrottle, OneLineAPeriodWithTheCountSinceTheLast) {
  LogThrottle t(200);
  uint64_t n = 0;
  ASSERT_TRUE(t.tick(&n));
  EXPECT_EQ(n, 1u);
  const auto start = std::chrono::steady_clock::now();
  int logged = 0;
  for (int i = 0; i < 99; ++i) logged += t.tick(&n);
  if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(200)) {
    EXPECT_EQ(logged, 0);  // within the period (a stalled machine may leave it)
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    ASSERT_TRUE(t.tick(&n));
    EXPECT_EQ(n, 100u);  // the 99 held back, and this one
  }
  EXPECT_EQ(LogThrottle::note(1), "");
  EXPECT_EQ(LogThrottle::note(100), " (100 since the last such line)");
}

TEST(ParseInt, Decimal) {
  int64_t v = -1;
  ASSERT_TRUE(ParseInt("0", 0, 1024, &v));
  EXPECT_EQ(v, 0);
  ASSERT_TRUE(ParseInt("42", 0, 1024, &v));
  EXPECT_EQ(v, 42);
  ASSERT_TRUE(ParseInt("+17", 0, 1024, &v));
  EXPECT_EQ(v, 17);
  ASSERT_TRUE(ParseInt("-7", -10, 10, &v));
  EXPECT_EQ(v, -7);
}

TEST(ParseInt, Hex) {
  int64_t v = -1;
  ASSERT_TRUE(ParseInt("0x10", 0, 1024, &v));
  EXPECT_EQ(v, 16);
  ASSERT_TRUE(ParseInt("0X1f", 0, 1024, &v));
  EXPECT_EQ(v, 31);
  ASSERT_TRUE(ParseInt("0x7fffffffffffffff", kMin, kMax, &v));
  EXPECT_EQ(v, kMax);
  EXPECT_FALSE(ParseInt("0x", 0, 1024, &v));  // no digits after the prefix
  EXPECT_FALSE(ParseInt("0xg1", 0, 1024, &v));
}

TEST(ParseInt, BoundsAreInclusive) {
  int64_t v = -1;
  ASSERT_TRUE(ParseInt("0", 0, 1024, &v));
  EXPECT_EQ(v, 0);
  ASSERT_TRUE(ParseInt("1024", 0, 1024, &v));
  EXPECT_EQ(v, 1024);

  std::string why;
  v = 99;
  EXPECT_FALSE(ParseInt("1025", 0, 1024, &v, &why));
  EXPECT_EQ(why, "is outside [0, 1024]");
  EXPECT_EQ(v, 99) << "out must be untouched on failure";
  EXPECT_FALSE(ParseInt("-1", 0, 1024, &v, &why));
  EXPECT_EQ(why, "is outside [0, 1024]");
  EXPECT_EQ(v, 99);
  EXPECT_FALSE(ParseInt("0x401", 0, 1024, &v));

  ASSERT_TRUE(ParseInt("-9223372036854775808", kMin, kMax, &v));
  EXPECT_EQ(v, kMin);
  ASSERT_TRUE(ParseInt("9223372036854775807", kMin, kMax, &v));
  EXPECT_EQ(v, kMax);
}

TEST(ParseInt, Junk) {
  for (const char* text :
       {"abc", "12abc", "1.5", "1e3", "5 ", " 5", "\t5", "\n5", "--5", "+", "-", "four", "0x10z"}) {
    int64_t v = 99;
    std::string why;
    EXPECT_FALSE(ParseInt(text, kMin, kMax, &v, &why)) << "'" << text << "'";
    EXPECT_EQ(why, "is not an integer") << "'" << text << "'";
    EXPECT_EQ(v, 99) << "'" << text << "'";
  }
}

TEST(ParseInt, Overflow) {
  for (const char* text : {"9223372036854775808", "-9223372036854775809",
                           "99999999999999999999999999", "0x10000000000000000"}) {
    int64_t v = 99;
    std::string why;
    EXPECT_FALSE(ParseInt(text, kMin, kMax, &v, &why)) << text;
    EXPECT_EQ(why, "is not an integer") << text;
    EXPECT_EQ(v, 99) << text;
  }
}

TEST(ParseInt, Empty) {
  int64_t v = 99;
  std::string why;
  EXPECT_FALSE(ParseInt("", kMin, kMax, &v, &why));
  EXPECT_EQ(why, "is not an integer");
  EXPECT_EQ(v, 99);
}

// ---------------------------------------------------------------------------
// params::parse_enum
// ---------------------------------------------------------------------------

using params::CodecPath;
using params::Tclass;

TEST(ParseEnum, ExactMatchEveryPosition) {
  const std::pair<const char*, CodecPath> cases[] = {{"auto", CodecPath::kAuto},
                                                     {"avx2", CodecPath::kAvx2},
                                                     {"avx512", CodecPath::kAvx512},
                                                     {"scalar", CodecPath::kScalar},
                                                     {"reference", CodecPath::kReference}};
  for (const auto& c : cases) {
    CodecPath out = CodecPath::kAuto;
    std::string why;
    ASSERT_TRUE(params::parse_enum(c.first, &out, &why)) << c.first;
    EXPECT_EQ(out, c.second) << c.first;
    EXPECT_STREQ(params::name_of(out), c.first);
  }
}

TEST(ParseEnum, CaseInsensitiveReturnsTypedValue) {
  CodecPath path = CodecPath::kAuto;
  std::string why;
  ASSERT_TRUE(params::parse_enum("AVX2", &path, &why));
  EXPECT_EQ(path, CodecPath::kAvx2);
  ASSERT_TRUE(params::parse_enum("AVX512", &path, &why));
  EXPECT_EQ(path, CodecPath::kAvx512);
  ASSERT_TRUE(params::parse_enum("ReFeReNcE", &path, &why));
  EXPECT_EQ(path, CodecPath::kReference);
  LogLevel level = LOG_NONE;
  ASSERT_TRUE(params::parse_enum("info", &level, &why));
  EXPECT_EQ(level, LOG_INFO);
  ASSERT_TRUE(params::parse_enum("trace", &level, &why));
  EXPECT_EQ(level, LOG_TRACE);  // 5: the list maps names to values, not to positions
  Tclass tc = Tclass::kUnspec;
  ASSERT_TRUE(params::parse_enum("bulk_data", &tc, &why));
  EXPECT_EQ(tc, Tclass::kBulkData);
  EXPECT_STREQ(params::name_of(tc), "BULK_DATA");
}

TEST(ParseEnum, Unknown) {
  for (const char* text : {"sse", "", "av", "avx2 ", " avx2", "auto|avx2", "avx512f", "avx"}) {
    CodecPath out = CodecPath::kScalar;
    std::string why;
    EXPECT_FALSE(params::parse_enum(text, &out, &why)) << "'" << text << "'";
    EXPECT_EQ(why, "is not one of auto|avx2|avx512|scalar|reference") << "'" << text << "'";
    EXPECT_EQ(out, CodecPath::kScalar) << "'" << text << "'";
  }
}

TEST(ParseEnum, ChoicesListedOnce) {
  EXPECT_EQ(params::choices_text<LogLevel>(), "NONE|VERSION|WARN|INFO|TRACE");
  EXPECT_EQ(params::choices_text<Tclass>(", "),
            "UNSPEC, DSCP, LABEL, BEST_EFFORT, LOW_LATENCY, DEDICATED_ACCESS, BULK_DATA, "
            "SCAVENGER, NETWORK_CTRL");
  EXPECT_STREQ(params::name_of(static_cast<LogLevel>(4)), "");  // not a listed value
}

// ---------------------------------------------------------------------------
// params::parse_float
// ---------------------------------------------------------------------------

TEST(ParseFloat, InRange) {
  // 1e-310 is subnormal: strtod flags ERANGE for it, and it is in range.
  const std::pair<const char*, double> cases[] = {{"0", 0.0},        {"1", 1.0},    {"0.5", 0.5},
                                                  {".25", 0.25},     {"1e-1", 0.1}, {"+0.75", 0.75},
                                                  {"1e-310", 1e-310}};
  for (const auto& c : cases) {
    double v = -1;
    std::string why;
    ASSERT_TRUE(params::parse_float(c.first, 0.0, 1.0, &v, &why)) << c.first << " " << why;
    EXPECT_EQ(v, c.second) << c.first;
  }
}

TEST(ParseFloat, Malformed) {
  const std::pair<const char*, const char*> cases[] = {{"", "is empty"},
                                                       {"half", "is not a number"},
                                                       {"0.5x", "is not a number"},
                                                       {"nan", "is not a number"},
                                                       {"inf", "is not a number"},
                                                       {"1e999", "is not a number"},
                                                       {"2", "is outside [0, 1]"},
                                                       {"-0.1", "is outside [0, 1]"},
                                                       {" 0.5", "is not a number"},
                                                       {"\t0.5", "is not a number"},
                                                       {"0.5 ", "is not a number"}};
  for (const auto& c : cases) {
    double v = 7;
    std::string why;
    EXPECT_FALSE(params::parse_float(c.first, 0.0, 1.0, &v, &why)) << "'" << c.first << "'";
    EXPECT_EQ(why, c.second) << "'" << c.first << "'";
    EXPECT_EQ(v, 7) << "'" << c.first << "'";
  }
}

TEST(ParseSize, CountsAndBinaryUnits) {
  const std::pair<const char*, uint64_t> cases[] = {{"0", 0},
                                                    {"262144", 262144},
                                                    {"256k", 262144},
                                                    {"256KiB", 262144},
                                                    {"256kb", 262144},
                                                    {"4M", 4u << 20},
                                                    {"16MB", 16u << 20},
                                                    {"1g", 1u << 30},
                                                    {"2T", 2ull << 40},
                                                    {"512b", 512},
                                                    {"18446744073709551615", UINT64_MAX},
                                                    {"16777215T", 16777215ull << 40}};
  for (const auto& c : cases) {
    uint64_t v = 7;
    std::string why;
    ASSERT_TRUE(params::parse_size(c.first, &v, &why)) << c.first << " " << why;
    EXPECT_EQ(v, c.second) << c.first;
  }
}

TEST(ParseSize, Malformed) {
  const char* const bad[] = {
      "",         "k",   "-1",  "+4",  "1.5M", "0x100", " 4",
      "4 M",      "4Mi", "4iB", "4MX", "4P",   "4bb",   "18446744073709551616",
      "16777216T"};
  for (const char* b : bad) {
    uint64_t v = 7;
    std::string why;
    EXPECT_FALSE(params::parse_size(b, &v, &why)) << "'" << b << "' was accepted as " << v;
    EXPECT_FALSE(why.empty()) << "'" << b << "'";
    EXPECT_EQ(v, 7u) << "'" << b << "'";
  }
}

TEST(ParseSize, InRange) {
  int64_t v = 0;
  std::string why;
  EXPECT_TRUE(params::parse_size_in("4k", 4096, 8192, &v, &why)) << why;
  EXPECT_EQ(v, 4096);
  EXPECT_FALSE(params::parse_size_in("4095", 4096, 8192, &v, &why));
  EXPECT_EQ(why, "is outside [4096, 8192] bytes");
  EXPECT_TRUE(params::parse_size_in("16T", 0, INT64_MAX, &v, &why)) << why;
  EXPECT_EQ(v, int64_t{1} << 44);
  // Above INT64_MAX, yet a valid size: out of range, not wrapped negative.
  EXPECT_FALSE(params::parse_size_in("18446744073709551615", 0, INT64_MAX, &v, &why));
  EXPECT_EQ(v, int64_t{1} << 44);
}

// ---------------------------------------------------------------------------
// parse_log_subsys
// ---------------------------------------------------------------------------

TEST(ParseLogSubsys, Lists) {
  uint32_t m = 0;
  std::string why;
  ASSERT_TRUE(parse_log_subsys("INIT", &m, &why));
  EXPECT_EQ(m, uint32_t{LOG_INIT});
  ASSERT_TRUE(parse_log_subsys("CODEC,NET", &m, &why));
  EXPECT_EQ(m, uint32_t{LOG_CODEC | LOG_NET});
  ASSERT_TRUE(parse_log_subsys("env,Model,init", &m, &why));
  EXPECT_EQ(m, uint32_t{LOG_ENV | LOG_MODEL | LOG_INIT});
  ASSERT_TRUE(parse_log_subsys("NET,NET", &m, &why));
  EXPECT_EQ(m, uint32_t{LOG_NET});
  ASSERT_TRUE(parse_log_subsys("ALL", &m, &why));
  EXPECT_EQ(m, ~0u);
  ASSERT_TRUE(parse_log_subsys("CODEC,ALL", &m, &why));
  EXPECT_EQ(m, ~0u);
}

TEST(ParseLogSubsys, CaretInverts) {
  uint32_t m = 0;
  std::string why;
  ASSERT_TRUE(parse_log_subsys("^CODEC", &m, &why));
  EXPECT_EQ(m, ~uint32_t{LOG_CODEC});
  EXPECT_EQ(m & LOG_CODEC, 0u);
  EXPECT_NE(m & LOG_NET, 0u);
  ASSERT_TRUE(parse_log_subsys("^INIT,ENV", &m, &why));
  EXPECT_EQ(m, ~uint32_t{LOG_INIT | LOG_ENV});
  ASSERT_TRUE(parse_log_subsys("^ALL", &m, &why));
  EXPECT_EQ(m, 0u);
}

TEST(ParseLogSubsys, UnknownNameIsAnError) {
  struct Case {
    const char* text;
    const char* name;
  };
  for (const Case& c :
       {Case{"FOO", "'FOO'"}, Case{"INIT,BOGUS", "'BOGUS'"}, Case{"^CODEC,NETT", "'NETT'"},
        Case{"INIT,,NET", "''"}, Case{"INIT,", "''"}, Case{"", "''"}, Case{"CODEC^", "'CODEC^'"}}) {
    uint32_t m = 0x1234;
    std::string why;
    EXPECT_FALSE(parse_log_subsys(c.text, &m, &why)) << "'" << c.text << "'";
    EXPECT_NE(why.find("unknown subsystem"), std::string::npos) << why;
    EXPECT_NE(why.find(c.name), std::string::npos) << why;
    EXPECT_EQ(m, 0x1234u) << "mask must be untouched on failure";
  }
}

// ---------------------------------------------------------------------------
// Per-thread error text
// ---------------------------------------------------------------------------

TEST(Error, SetLastClear) {
  clear_error();
  EXPECT_STREQ(last_error(), "");
  EXPECT_EQ(set_error(KVXFER_ERR_CORRUPT, "bad %s at %d", "checksum", 7), KVXFER_ERR_CORRUPT);
  EXPECT_STREQ(last_error(), "bad checksum at 7");
  EXPECT_STREQ(kvxfer_get_last_error(), "bad checksum at 7");
  EXPECT_EQ(set_error(KVXFER_ERR_TRUNCATED, "second"), KVXFER_ERR_TRUNCATED);
  EXPECT_STREQ(last_error(), "second") << "the last error replaces the previous one";
  clear_error();
  EXPECT_STREQ(last_error(), "");
  EXPECT_STREQ(kvxfer_get_last_error(), "");
}

TEST(Error, LongMessageIsTruncatedNotOverflowed) {
  std::string big(5000, 'x');
  set_error(KVXFER_ERR_INTERNAL, "%s", big.c_str());
  const std::string got = last_error();
  EXPECT_GT(got.size(), 100u);
  EXPECT_LT(got.size(), big.size());
  EXPECT_EQ(got, std::string(got.size(), 'x'));
  clear_error();
}

TEST(Error, PerThread) {
  clear_error();
  set_error(KVXFER_ERR_MISMATCH, "main thread error");
  std::string seen_first, seen_after;
  std::thread t([&] {
    seen_first = last_error();
    set_error(KVXFER_ERR_SYSTEM, "worker thread error");
    seen_after = kvxfer_get_last_error();
  });
  t.join();
  EXPECT_EQ(seen_first, "") << "a new thread must not see another thread's error";
  EXPECT_EQ(seen_after, "worker thread error");
  EXPECT_STREQ(last_error(), "main thread error") << "the worker must not overwrite main's error";
  clear_error();
}

TEST(Error, ApiCallsClearAndSetTheText) {
  set_error(KVXFER_ERR_CORRUPT, "stale");
  int version = 0;
  ASSERT_EQ(kvxfer_get_version(&version), KVXFER_SUCCESS);
  EXPECT_EQ(version, KVXFER_VERSION_CODE);
  EXPECT_STREQ(kvxfer_get_last_error(), "") << "a successful call clears the error text";
  EXPECT_EQ(kvxfer_get_version(nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(kvxfer_get_last_error(), "version is NULL"), nullptr)
      << kvxfer_get_last_error();
}

TEST(Error, EveryCodeHasADistinctString) {
  const std::string unknown = kvxfer_get_error_string(static_cast<kvxfer_result_t>(12345));
  EXPECT_FALSE(unknown.empty());
  std::set<std::string> seen;
  int count = 0;
  for (int r = KVXFER_RESULT_MIN; r <= KVXFER_IN_PROGRESS; ++r, ++count) {
    const char* s = kvxfer_get_error_string(static_cast<kvxfer_result_t>(r));
    ASSERT_NE(s, nullptr) << r;
    EXPECT_GT(std::strlen(s), 0u) << r;
    EXPECT_NE(unknown, s) << "code " << r << " has no string of its own";
    EXPECT_TRUE(seen.insert(s).second) << "code " << r << " repeats '" << s << "'";
  }
  EXPECT_EQ(count, 1 - KVXFER_RESULT_MIN + 1);
  EXPECT_STREQ(kvxfer_get_error_string(KVXFER_SUCCESS), "success");
  for (int r : {KVXFER_RESULT_MIN - 1, KVXFER_IN_PROGRESS + 1, -1000, 1000}) {
    const char* s = kvxfer_get_error_string(static_cast<kvxfer_result_t>(r));
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(unknown, s) << r;
  }
}

// ---------------------------------------------------------------------------
// params.def: every declared default is valid, and docs/ENV.md covers it
// ---------------------------------------------------------------------------

TEST(Params, DeclaredDefaultsAreValid) {
  int n = 0;
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc)     \
  {                                                       \
    ++n;                                                  \
    EXPECT_LE(int64_t{lo}, int64_t{def}) << env;          \
    EXPECT_LE(int64_t{def}, int64_t{hi}) << env;          \
    EXPECT_STRNE(doc, "") << env;                         \
    EXPECT_EQ(std::strncmp(env, "KVXFER_", 7), 0) << env; \
  }
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc) KVXFER_PARAM_INT(Name, env, def, lo, hi, doc)
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc)   \
  {                                                       \
    ++n;                                                  \
    EXPECT_LE(lo, def) << env;                            \
    EXPECT_LE(def, hi) << env;                            \
    EXPECT_STRNE(doc, "") << env;                         \
    EXPECT_EQ(std::strncmp(env, "KVXFER_", 7), 0) << env; \
  }
#define KVXFER_PARAM_RATE(Name, env, def, doc)                           \
  {                                                                      \
    ++n;                                                                 \
    double v = 0;                                                        \
    std::string why;                                                     \
    EXPECT_TRUE(params::parse_rate(def, &v, &why)) << env << " " << why; \
    EXPECT_STRNE(doc, "") << env;                                        \
    EXPECT_EQ(std::strncmp(env, "KVXFER_", 7), 0) << env;                \
  }
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc)                        \
  {                                                                                  \
    ++n;                                                                             \
    EXPECT_LT(params::choice_index(Type::def), params::Choices<Type>::count) << env; \
    EXPECT_STRNE(doc, "") << env;                                                    \
    EXPECT_EQ(std::strncmp(env, "KVXFER_", 7), 0) << env;                            \
  }
#define KVXFER_PARAM_STRING(Name, env, def, doc)          \
  {                                                       \
    ++n;                                                  \
    EXPECT_STRNE(doc, "") << env;                         \
    EXPECT_EQ(std::strncmp(env, "KVXFER_", 7), 0) << env; \
  }
#define KVXFER_PARAM_SECTION(title, doc)
#include "common/params.def"
  EXPECT_GT(n, 0);
  uint32_t mask = 0;
  std::string why;
  EXPECT_TRUE(parse_log_subsys("ALL", &mask, &why)) << "KVXFER_DEBUG_SUBSYS default";
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string RepoRoot() {
  std::string here = __FILE__;  // <repo>/tests/common_test.cc (CMake passes absolute paths)
  return here.substr(0, here.rfind("/tests/"));
}

TEST(Params, DocumentedInParametersMd) {
  const std::string path = RepoRoot() + "/docs/ENV.md";
  const std::string doc = ReadFile(path);
  ASSERT_FALSE(doc.empty()) << "cannot read " << path;
  auto documented = [&](const char* env, const std::string& def) {
    // Each variable has a section headed "### `KVXFER_X`" that states its
    // default as "Default: `value`" (or "Default: (empty)").
    const std::string head = std::string("### `") + env + "`";
    size_t at = doc.find(head);
    EXPECT_NE(at, std::string::npos) << env << " has no section in " << path;
    if (at == std::string::npos) return;
    size_t end = doc.find("\n### ", at + head.size());
    const std::string section = doc.substr(at, end == std::string::npos ? end : end - at);
    const std::string want = def.empty() ? "Default: (empty)" : "Default: `" + def + "`";
    EXPECT_NE(section.find(want), std::string::npos) << env << ": its section must say " << want;
  };
#define KVXFER_PARAM_SECTION(title, doc)
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc) documented(env, std::to_string(def));
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc) documented(env, std::to_string(def));
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc) documented(env, strprintf("%g", def));
#define KVXFER_PARAM_RATE(Name, env, def, doc) documented(env, def);
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc) \
  documented(env, params::name_of(Type::def));
#define KVXFER_PARAM_STRING(Name, env, def, doc) documented(env, def);
#include "common/params.def"
}

// ---------------------------------------------------------------------------
// The environment, in child processes: parameters are read once per process,
// so each case sets its variables in a freshly started child ("threadsafe"
// death tests re-execute the test binary) and reports through its exit code.
// ---------------------------------------------------------------------------

// In the child: sets `env`=`value`, makes an API call, and exits 0 when it
// fails with KVXFER_ERR_INVALID_ARGUMENT naming the variable and its value.
[[noreturn]] void ExpectMalformed(const char* env, const char* value) {
  setenv(env, value, 1);
  int version = 0;
  kvxfer_result_t r = kvxfer_get_version(&version);
  const std::string text = kvxfer_get_last_error();
  std::fprintf(stderr, "result %d: %s\n", static_cast<int>(r), text.c_str());
  const bool ok = r == KVXFER_ERR_INVALID_ARGUMENT &&
                  text.find(std::string(env) + "='" + value + "'") != std::string::npos &&
                  text.find("malformed environment") != std::string::npos;
  // Every later call fails the same way.
  kvxfer_result_t again = kvxfer_get_version(&version);
  std::_Exit(ok && again == KVXFER_ERR_INVALID_ARGUMENT ? 0 : 1);
}

class Environment : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(Environment, MalformedIntFailsEveryCall) {
  EXPECT_EXIT(ExpectMalformed("KVXFER_CODEC_THREADS", "lots"), ::testing::ExitedWithCode(0),
              "KVXFER_CODEC_THREADS='lots' is not an integer");
  EXPECT_EXIT(ExpectMalformed("KVXFER_CODEC_THREADS", "65"), ::testing::ExitedWithCode(0),
              "KVXFER_CODEC_THREADS='65' is outside \\[0, 64\\]");
}

// In the child, at KVXFER_DEBUG=INFO: a malformed value is logged as
// malformed, never as "set by environment to" the default it falls back to.
[[noreturn]] void LogsMalformedNotAsSet(const char* env, const char* value) {
  const std::string log = ::testing::TempDir() + "kvxfer_env_log_" + std::to_string(getpid());
  setenv("KVXFER_DEBUG", "INFO", 1);
  setenv("KVXFER_DEBUG_FILE", log.c_str(), 1);
  setenv(env, value, 1);
  int version = 0;
  const kvxfer_result_t r = kvxfer_get_version(&version);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(log.c_str());
  std::fprintf(stderr, "%s", text.c_str());
  const bool ok = r == KVXFER_ERR_INVALID_ARGUMENT &&
                  text.find("malformed environment") != std::string::npos &&
                  text.find(std::string(env) + " set by environment") == std::string::npos;
  std::_Exit(ok ? 0 : 1);
}

TEST_F(Environment, AMalformedValueIsNotLoggedAsSet) {
  for (const auto& [env, value] :
       {std::pair<const char*, const char*>{"KVXFER_CODEC_THREADS", "lots"},
        {"KVXFER_STAGING_CACHE_BYTES", "4Mi"},
        {"KVXFER_RATE_LIMIT", "fast"},
        {"KVXFER_CODEC_IMPL", "avx9"}}) {
    SCOPED_TRACE(env);
    EXPECT_EXIT(LogsMalformedNotAsSet(env, value), ::testing::ExitedWithCode(0), "");
  }
}

TEST_F(Environment, MalformedEnumFailsEveryCall) {
  EXPECT_EXIT(ExpectMalformed("KVXFER_CODEC_IMPL", "sse9"), ::testing::ExitedWithCode(0),
              "KVXFER_CODEC_IMPL='sse9' is not one of auto\\|avx2\\|avx512\\|scalar\\|reference");
  EXPECT_EXIT(ExpectMalformed("KVXFER_DEBUG", "LOUD"), ::testing::ExitedWithCode(0),
              "KVXFER_DEBUG='LOUD'");
}

TEST_F(Environment, MalformedSubsysFailsEveryCall) {
  EXPECT_EXIT(ExpectMalformed("KVXFER_DEBUG_SUBSYS", "INIT,DISK"), ::testing::ExitedWithCode(0),
              "KVXFER_DEBUG_SUBSYS='INIT,DISK' names an unknown subsystem 'DISK'");
}

TEST_F(Environment, MalformedRateFailsEveryCall) {
  // Checked by params::validate() like every other variable, not only when a
  // link is created.
  EXPECT_EXIT(ExpectMalformed("KVXFER_RATE_LIMIT", "fast"), ::testing::ExitedWithCode(0),
              "KVXFER_RATE_LIMIT='fast'");
  EXPECT_EXIT(ExpectMalformed("KVXFER_RATE_LIMIT", "25gb"), ::testing::ExitedWithCode(0),
              "KVXFER_RATE_LIMIT='25gb'");
}

TEST_F(Environment, MalformedSizeFailsEveryCall) {
  EXPECT_EXIT(ExpectMalformed("KVXFER_NET_CHUNK_BYTES", "4 MB"), ::testing::ExitedWithCode(0),
              "KVXFER_NET_CHUNK_BYTES='4 MB' has an unknown unit");
  EXPECT_EXIT(ExpectMalformed("KVXFER_NET_CHUNK_BYTES", "1k"), ::testing::ExitedWithCode(0),
              "KVXFER_NET_CHUNK_BYTES='1k' is outside \\[4096, 67108864\\] bytes");
}

TEST_F(Environment, MalformedFloatFailsEveryCall) {
  EXPECT_EXIT(ExpectMalformed("KVXFER_SPEC_MIN_ACCEPT", "half"), ::testing::ExitedWithCode(0),
              "KVXFER_SPEC_MIN_ACCEPT='half' is not a number");
  EXPECT_EXIT(ExpectMalformed("KVXFER_SPEC_MIN_ACCEPT", "2"), ::testing::ExitedWithCode(0),
              "KVXFER_SPEC_MIN_ACCEPT='2' is outside \\[0, 1\\]");
}

TEST_F(Environment, MalformedTrafficClassFailsEveryCall) {
  EXPECT_EXIT(ExpectMalformed("KVXFER_RESIDUAL_TC", "FAST"), ::testing::ExitedWithCode(0),
              "KVXFER_RESIDUAL_TC='FAST' is not one of UNSPEC\\|DSCP\\|");
}

// Callers get typed values: bytes/s, a number, enumerators; parsed once, here.
TEST_F(Environment, TypedValues) {
  EXPECT_EXIT(
      {
        setenv("KVXFER_RATE_LIMIT", "8mbit", 1);
        setenv("KVXFER_SPEC_MIN_ACCEPT", "0.25", 1);
        setenv("KVXFER_ANCHOR_TC", "scavenger", 1);
        setenv("KVXFER_NET_CHUNK_BYTES", "512k", 1);
        setenv("KVXFER_RECV_STAGING_BYTES", "33554432", 1);
        int version = 0;
        kvxfer_result_t r = kvxfer_get_version(&version);
        std::fprintf(stderr, "result %d: %s\n", static_cast<int>(r), kvxfer_get_last_error());
        std::_Exit(
            r == KVXFER_SUCCESS && params::RateLimit() == 1e6 && params::SpecMinAccept() == 0.25 &&
                    params::AnchorTc() == Tclass::kScavenger &&
                    params::ResidualTc() == Tclass::kBulkData &&
                    params::NetChunkBytes() == 524288 && params::RecvStagingBytes() == 33554432 &&
                    params::CodecImpl() == CodecPath::kAuto && params::Debug() == LOG_WARN
                ? 0
                : 1);
      },
      ::testing::ExitedWithCode(0), "result 0");
  EXPECT_EXIT(
      {
        int version = 0;
        kvxfer_result_t r = kvxfer_get_version(&version);
        std::fprintf(stderr, "result %d\n", static_cast<int>(r));
        std::_Exit(r == KVXFER_SUCCESS && params::RateLimit() == 0 && params::SpecMinAccept() == 0.5
                       ? 0
                       : 1);
      },
      ::testing::ExitedWithCode(0), "result 0");
}

TEST_F(Environment, WellFormedValuesAreAccepted) {
  EXPECT_EXIT(
      {
        setenv("KVXFER_CODEC_THREADS", "0x2", 1);
        setenv("KVXFER_CODEC_IMPL", "SCALAR", 1);
        setenv("KVXFER_DEBUG", "none", 1);
        setenv("KVXFER_DEBUG_SUBSYS", "^net,model", 1);
        int version = 0;
        kvxfer_result_t r = kvxfer_get_version(&version);
        std::fprintf(stderr, "result %d: %s\n", static_cast<int>(r), kvxfer_get_last_error());
        std::_Exit(r == KVXFER_SUCCESS && params::CodecThreads() == 2 &&
                           params::CodecImpl() == CodecPath::kScalar && params::Debug() == LOG_NONE
                       ? 0
                       : 1);
      },
      ::testing::ExitedWithCode(0), "result 0");
}

// The documented log line: host:pid:tid [kvxfer] SUBSYS LEVEL message, written
// to KVXFER_DEBUG_FILE with %p expanded; an ENV line for each variable set.
TEST_F(Environment, LogLineFormatAndDebugFile) {
  const std::string dir = ::testing::TempDir();
  EXPECT_EXIT(
      {
        const std::string pattern = dir + "kvxfer-common-test-%p.log";
        const std::string path = dir + "kvxfer-common-test-" + std::to_string(getpid()) + ".log";
        setenv("KVXFER_DEBUG", "INFO", 1);
        setenv("KVXFER_DEBUG_SUBSYS", "ENV,CODEC", 1);
        setenv("KVXFER_DEBUG_FILE", pattern.c_str(), 1);
        setenv("KVXFER_CODEC_THREADS", "3", 1);
        int version = 0;
        kvxfer_result_t r = kvxfer_get_version(&version);
        KVXFER_INFO(LOG_CODEC, "codec line %d", 42);
        KVXFER_INFO(LOG_NET, "net line is filtered out");
        KVXFER_WARN(LOG_MODEL, "model line is filtered out");
        const std::string log = ReadFile(path);
        std::remove(path.c_str());
        std::fprintf(stderr, "result %d, log:\n%s", static_cast<int>(r), log.c_str());
        const std::string pid = std::to_string(getpid());
        const std::regex env_line("(^|\n)[^:\n]+:" + pid +
                                  ":[0-9]+ \\[kvxfer\\] ENV INFO KVXFER_CODEC_THREADS set by "
                                  "environment to 3\n");
        const std::regex codec_line("(^|\n)[^:\n]+:" + pid +
                                    ":[0-9]+ \\[kvxfer\\] CODEC INFO codec line 42\n");
        const bool ok = r == KVXFER_SUCCESS && std::regex_search(log, env_line) &&
                        std::regex_search(log, codec_line) &&
                        log.find("filtered out") == std::string::npos;
        std::_Exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "result 0");
}

}  // namespace
}  // namespace kvxfer

// ---------------------------------------------------------------------------
// common/struct_abi.h: the size/magic/version rule of the public structs
// ---------------------------------------------------------------------------

namespace kvxfer {

/** A struct with two layouts: {size, magic, version, a} and, appended, b. */
struct TestConfig {
  size_t size;
  uint32_t magic;
  uint32_t version;
  int64_t a;
  int64_t b;
};
#define TEST_CONFIG_INITIALIZER \
  { sizeof(TestConfig), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 10, 20 }
KVXFER_STRUCT_ABI(TestConfig, "test config", TEST_CONFIG_INITIALIZER, offsetof(TestConfig, b));

namespace {

TestConfig caller(size_t size) {
  TestConfig t{sizeof(TestConfig), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 7, 99};
  t.size = size;
  return t;
}

TEST(StructAbi, OlderSmallerStructTakesTheDefaults) {
  TestConfig in = caller(24), out{};
  ASSERT_EQ(read_struct(&in, &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.a, 7);   // the caller's
  EXPECT_EQ(out.b, 20);  // past size 24: the initializer's, not the 99 in memory
  EXPECT_EQ(out.size, sizeof(TestConfig));
  in = caller(32);
  ASSERT_EQ(read_struct(&in, &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.a, 7);
  EXPECT_EQ(out.b, 99);
}

TEST(StructAbi, LargerMisfitBadMagicAndOtherVersionsAreRefused) {
  struct Case {
    const char* name;
    TestConfig in;
    const char* message;
  };
  TestConfig magic = caller(32), major = caller(32), minor = caller(32), zero = caller(32);
  magic.magic = 0;
  major.version = KVXFER_VERSION_CODE + 10000;
  minor.version = KVXFER_VERSION_CODE + 100;
  zero.version = 0;
  const Case cases[] = {
      {"larger", caller(40),
       "pre: test config has size 40, larger than the 32 bytes of this library's kvxfer.h"},
      {"magic", magic,
       "pre: test config not initialised (size 32, magic 0x0): use TEST_CONFIG_INITIALIZER"},
      {"below the first layout", caller(16),
       "pre: test config not initialised (size 16, magic 0x6b767866): the size must be 24 to 32, "
       "a multiple of 8; use TEST_CONFIG_INITIALIZER"},
      {"not a layout", caller(28), "(size 28, magic 0x6b767866): the size must be 24 to 32"},
      {"major", major, "the major version must match"},
      {"minor", minor, "is newer than this library"},
      // Major 0 matches this library's; 0.0.x is below the first header.
      {"zero version", zero,
       "pre: test config from header version 0 is older than the first kvxfer.h (100): no "
       "header had it; use TEST_CONFIG_INITIALIZER"},
  };
  for (const Case& c : cases) {
    TestConfig out = caller(32);
    out.a = 1;
    EXPECT_EQ(read_struct(&c.in, &out, "pre: "), KVXFER_ERR_INVALID_ARGUMENT) << c.name;
    EXPECT_NE(std::string(last_error()).find(c.message), std::string::npos)
        << c.name << ": " << last_error();
    EXPECT_EQ(out.a, 1) << c.name;  // untouched
  }
  TestConfig patch = caller(32), out{};
  patch.version = KVXFER_VERSION_CODE + 1;
  EXPECT_EQ(read_struct(&patch, &out), KVXFER_SUCCESS) << last_error();
  // A struct read in place must have every field.
  const TestConfig older = caller(24);
  EXPECT_EQ(check_struct(&older), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(check_struct_in_place(&older), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("the size must be 32 to 32"), std::string::npos)
      << last_error();
}

// kvxfer_request_config_t without `stream_layers` (size 56): 0, the
// initializer's, not the 1 past the caller's 56 bytes.
TEST(StructAbi, OlderRequestConfigDoesNotStreamLayers) {
  static_assert(offsetof(kvxfer_request_config_t, stream_layers) == 56,
                "the layout this test knows");
  kvxfer_request_config_t in = KVXFER_REQUEST_CONFIG_INITIALIZER, out{};
  in.tag = 77;
  in.stream_layers = 1;
  in.size = offsetof(kvxfer_request_config_t, stream_layers);
  ASSERT_EQ(read_struct(&in, &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.tag, 77u);
  EXPECT_EQ(out.stream_layers, 0);
  in.size = sizeof(in);
  ASSERT_EQ(read_struct(&in, &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.stream_layers, 1);
}

// kvxfer_request_config_t without `claim_timeout_ms` (size 72): 0, the
// communicator's timeout.
TEST(StructAbi, OlderRequestConfigWaitsTheCommunicatorsTimeout) {
  static_assert(offsetof(kvxfer_request_config_t, claim_timeout_ms) == 72,
                "the layout this test knows");
  kvxfer_request_config_t in = KVXFER_REQUEST_CONFIG_INITIALIZER, out{};
  in.request_id = 9;
  in.claim_timeout_ms = 5;
  in.size = offsetof(kvxfer_request_config_t, claim_timeout_ms);
  ASSERT_EQ(read_struct(&in, &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.request_id, 9u);
  EXPECT_EQ(out.claim_timeout_ms, 0);
  in.size = sizeof(in);
  ASSERT_EQ(read_struct(&in, &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.claim_timeout_ms, 5);
}

// kvxfer_kv_desc_t without `device` (size 80): read_kv_desc gives device -1
// (host, the initializer's), not what lies past the caller's 80 bytes.
TEST(StructAbi, OlderKvDescIsHostMemory) {
  static_assert(offsetof(kvxfer_kv_desc_t, device) == 80, "the layout this test knows");
  kvxfer_kv_desc_t in = KVXFER_KV_DESC_INITIALIZER, out{};
  in.num_layers = 3;
  in.device = 5;
  in.size = offsetof(kvxfer_kv_desc_t, device);
  ASSERT_EQ(codec::read_kv_desc(&in, "", &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.num_layers, 3);
  EXPECT_EQ(out.device, -1);
  EXPECT_EQ(out.size, sizeof(kvxfer_kv_desc_t));
  in.size = sizeof(kvxfer_kv_desc_t);
  ASSERT_EQ(codec::read_kv_desc(&in, "", &out), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.device, 5);
  in.size = sizeof(kvxfer_kv_desc_t) + 8;
  EXPECT_EQ(codec::read_kv_desc(&in, "op 2: ", &out), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("op 2: KV descriptor has size 96, larger than the 88"),
            std::string::npos)
      << last_error();
}

}  // namespace
}  // namespace kvxfer
