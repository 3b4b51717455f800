// Shared harness of the kvxfer perf binaries (perf/codec_perf, perf/kvxfer_perf,
// perf/net_plugin_perf, ...).
//
// What it gives a benchmark, in the nccl-tests dialect:
//   * the common flags (-w warmup iterations, -n timed iterations, -c check,
//     -J JSON file, --quick) registered on a CLI11 app;
//   * a timing loop over std::chrono::steady_clock that reports the median
//     (and mean/min/max) of the timed iterations;
//   * a fixed-width table: header lines start with '#', data rows with ' ',
//     columns right-aligned and separated by two spaces, so the output reads
//     like nccl-tests and parses with awk;
//   * the preamble: one line for the machine (CPU model, CPUs, AVX2/F16C) and
//     one for the KVXFER_* settings in effect;
//   * a JSON writer (nlohmann_json);
//   * the -b/-e/-f size sweep, and a forked peer process (ForkedChild).
// Formulas are defined in docs/PERFORMANCE.md.  Nothing here asserts on time.
#pragma once

#include <sys/types.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::perf {

// ---------------------------------------------------------------------------
// Flags shared by every perf binary.
// ---------------------------------------------------------------------------
struct CommonOptions {
  int warmup = 1;         // -w: untimed iterations before timing
  int iters = 5;          // -n: timed iterations; the median is reported
  int check = 1;          // -c: 1 = verify results bit-exactly, 0 = skip
  std::string json_path;  // -J: write every result to this file
  bool quick = false;     // --quick: smaller problem, fewer iterations
};

/** Registers -w/--warmup_iters, -n/--iters, -c/--check, -J/--json, --quick. */
void add_common_options(CLI::App* app, CommonOptions* opt);

// ---------------------------------------------------------------------------
// Timing.
// ---------------------------------------------------------------------------
struct Stats {
  int iters = 0;
  double median_us = 0, mean_us = 0, min_us = 0, max_us = 0;
};

/** Median (mean of the two middle values for an even count), mean, min, max. */
Stats summarize(std::vector<double> samples_us);

/**
 * Runs `fn` `warmup` times untimed, then `iters` times, timing each call
 * with std::chrono::steady_clock.  Stops at the first call that returns
 * false and returns false (the caller reports why).  iters must be >= 1.
 */
bool time_loop(int warmup, int iters, const std::function<bool()>& fn, Stats* out);

/**
 * time_loop of `fn` with a baseline `base` (for example memcpy of the same
 * bytes) timed just before every call, so that both see the same state of a
 * noisy machine: ratios of their medians are then measured side by side,
 * not minutes apart.  Warm-up runs both `warmup` times.
 */
bool time_paired(int warmup, int iters, const std::function<bool()>& base,
                 const std::function<bool()>& fn, Stats* base_out, Stats* out);

/** Throughput in GB/s (10^9 bytes per second) of `bytes` processed in `us`. */
inline double gbps(double bytes, double us) { return us > 0 ? bytes / us * 1e-3 : 0.0; }

/**
 * A byte count in the size grammar of the KVXFER_*_BYTES parameters
 * (params::parse_size, src/common/units.h): "8M", "1G", "512K", "1048576",
 * "64MiB".  False on anything else or on overflow.
 */
bool parse_size(const std::string& s, uint64_t* out);

/**
 * The sizes of a -b/-e/-f sweep, as nccl-tests walks them: min, min * factor,
 * min * factor^2, ... while <= max.  Empty when min > max; just {min} when
 * factor <= 1 (no step to take).  A step that would pass max, or overflow
 * uint64_t, ends the sweep.  The binaries round each size as they need to
 * (kvxfer_perf: to whole tokens).
 */
std::vector<uint64_t> size_sweep(uint64_t min, uint64_t max, uint64_t factor);

/** The next value of a splitmix64 stream (advances *state). */
inline uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/** 0..n-1 in the fixed pseudo-random order of a Fisher-Yates shuffle driven
 *  by splitmix64(seed): the block order of the benchmarks' paged pools. */
inline std::vector<size_t> shuffled_indices(size_t n, uint64_t seed) {
  std::vector<size_t> perm(n);
  for (size_t i = 0; i < n; ++i) perm[i] = i;
  for (size_t i = n; i > 1; --i) std::swap(perm[i - 1], perm[splitmix64(&seed) % i]);
  return perm;
}

/** Splits a comma list ("lynx,int8"), dropping empty items. */
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

/** Short names for tables and JSON: "bf16"/"fp16"/"fp32", "lynx"/"int8"/"int4"/"bf16". */
inline const char* dtype_name(kvxfer_dtype_t d) {
  return d == KVXFER_DTYPE_BF16 ? "bf16" : d == KVXFER_DTYPE_FP16 ? "fp16" : "fp32";
}
inline const char* codec_name(kvxfer_codec_t c) {
  switch (c) {
    case KVXFER_CODEC_LYNX: return "lynx";
    case KVXFER_CODEC_INT8: return "int8";
    case KVXFER_CODEC_INT4: return "int4";
    case KVXFER_CODEC_SPECTRUM: return "spectrum";
    default: return "bf16";
  }
}

nlohmann::json to_json(const Stats& s);

// ---------------------------------------------------------------------------
// Fixed-width table.
// ---------------------------------------------------------------------------
class Table {
 public:
  struct Column {
    std::string name;
    int width = 0;  // minimum width; the name's length wins if larger
  };
  explicit Table(std::vector<Column> cols);

  /** The header line: '#' then every column name right-aligned. */
  std::string header() const;
  /** A data row: ' ' then every cell right-aligned (cells.size() == columns). */
  std::string row(const std::vector<std::string>& cells) const;
  size_t columns() const { return cols_.size(); }

 private:
  std::vector<Column> cols_;
};

/** printf into a std::string. */
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ---------------------------------------------------------------------------
// Machine and settings.
// ---------------------------------------------------------------------------
struct MachineInfo {
  std::string host;
  std::string cpu_model;  // first "model name" of /proc/cpuinfo, "unknown" if absent
  int logical_cpus = 0;   // std::thread::hardware_concurrency()
  int usable_cpus = 0;    // CPUs in this process's affinity mask
  bool avx2 = false;
  bool f16c = false;
};
MachineInfo machine_info();

/** One KVXFER_* parameter (common/params.def) with its effective value. */
struct Setting {
  std::string name;
  std::string value;
  bool from_env = false;  // set in the environment (else the default)
};
std::vector<Setting> kvxfer_settings();

/**
 * Prints the preamble:
 *   # <tool>: kvxfer <version> on <host>
 *   # CPU: <model> | <n> logical CPUs (<m> usable) | AVX2 yes/no, F16C yes/no
 *   # Settings: KVXFER_X=v ... (* = set in the environment)
 */
void print_preamble(FILE* out, const char* tool, const MachineInfo& m,
                    const std::vector<Setting>& settings);

nlohmann::json to_json(const MachineInfo& m);
nlohmann::json to_json(const std::vector<Setting>& s);

/** Writes `j` (indented) to `path`; false and *error on failure. */
bool write_json_file(const std::string& path, const nlohmann::json& j, std::string* error);

/**
 * The -J step of a perf binary: nothing when `path` is empty; else writes `j`
 * and prints "# JSON written to <path>", or "<tool>: <error>" on stderr.
 * Returns 0, or 2 (the binaries' usage/IO exit status) on failure.
 */
int emit_json(const char* tool, const std::string& path, const nlohmann::json& j);

// ---------------------------------------------------------------------------
// A forked peer process (the other rank of a two-process benchmark).
// ---------------------------------------------------------------------------
/**
 * One child process running `body`.  start() flushes every stdio stream
 * (so nothing buffered is written twice), forks, and in the child sets
 * PR_SET_PDEATHSIG to SIGKILL (it never outlives the parent), exits with
 * status 3 if the parent is already gone, then ends with _exit(body()) (no
 * atexit handlers, no stdio flush, no destructors of the parent's objects).
 * Pipes between the two are the caller's: create them before start(), close
 * the unused ends in the body and after it.  Fork before the parent starts
 * threads (OpenMP): a child forked after may hang in them.
 *
 * The parent polls alive(), waits with wait() or wait_for(), or kill()s.
 * The destructor kills and reaps a child that is still running.
 */
class ForkedChild {
 public:
  ForkedChild() = default;
  ~ForkedChild();
  ForkedChild(const ForkedChild&) = delete;
  ForkedChild& operator=(const ForkedChild&) = delete;

  /** Starts the child; false and *error ("fork: <strerror>") if fork fails. */
  bool start(const std::function<int()>& body, std::string* error);

  /** In the child (from the body): whether the parent that forked it still runs. */
  bool parent_alive() const;

  /** In the parent: false once the child has ended (it is then reaped). */
  bool alive();
  /** Blocks until the child ends. */
  void wait();
  /**
   * Waits up to `seconds` for the child to end (polling every 10 ms), then
   * SIGKILLs and reaps it.  True if it ended on its own.
   */
  bool wait_for(double seconds);
  /** SIGKILL and reap (nothing when it has already been reaped). */
  void kill();

  /** The waitpid status once reaped, -1 before. */
  int status() const { return status_; }
  /** Reaped after exiting with status 0. */
  bool exited_ok() const;
  /** How it ended: "exit code N", "killed by signal S", "running" or "not started". */
  std::string describe() const;

 private:
  pid_t pid_ = -1;
  pid_t parent_ = -1;
  int status_ = -1;
  bool reaped_ = false;
};

/**
 * main()'s body of a perf binary: std::bad_alloc and std::length_error (sizes
 * beyond the machine, or beyond a container) become "<tool>: not enough
 * memory for these sizes" or "<tool>: sizes out of range (...)" on stderr and
 * status 2, not an abort.  A ForkedChild's body gets the same, in the child.
 */
int guarded_main(const char* tool, const std::function<int()>& body);

/** MemAvailable of /proc/meminfo, in bytes; 0 when unknown. */
uint64_t mem_available_bytes();

/** A field of /proc/self/status in KiB ("VmRSS", "VmHWM", "RssAnon", ...);
 *  -1 when absent. */
long proc_status_kib(const char* field);

}  // namespace kvxfer::perf
