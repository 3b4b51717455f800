#include "perf/common/harness.h"

#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <stdexcept>
#include <thread>

#include "common/params.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::perf {

void add_common_options(CLI::App* app, CommonOptions* opt) {
  app->add_option("-w,--warmup_iters", opt->warmup, "untimed iterations before timing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("-n,--iters", opt->iters, "timed iterations (the median is reported)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("-c,--check", opt->check, "1: verify results bit-exactly, 0: skip")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  app->add_option("-J,--json", opt->json_path, "write all results to this JSON file");
  app->add_flag("--quick", opt->quick, "smaller problem and fewer iterations");
}

Stats summarize(std::vector<double> v) {
  Stats s;
  s.iters = static_cast<int>(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median_us = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  double sum = 0;
  for (double x : v) sum += x;
  s.mean_us = sum / static_cast<double>(n);
  s.min_us = v.front();
  s.max_us = v.back();
  return s;
}

bool time_loop(int warmup, int iters, const std::function<bool()>& fn, Stats* out) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i)
    if (!fn()) return false;
  std::vector<double> us;
  us.reserve(static_cast<size_t>(std::max(iters, 0)));
  for (int i = 0; i < iters; ++i) {
    const auto t0 = clock::now();
    const bool ok = fn();
    const auto t1 = clock::now();
    if (!ok) return false;
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  *out = summarize(std::move(us));
  return true;
}

bool time_paired(int warmup, int iters, const std::function<bool()>& base,
                 const std::function<bool()>& fn, Stats* base_out, Stats* out) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i)
    if (!base() || !fn()) return false;
  std::vector<double> ub, uf;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = clock::now();
    const bool okb = base();
    const auto t1 = clock::now();
    const bool okf = fn();
    const auto t2 = clock::now();
    if (!okb || !okf) return false;
    ub.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    uf.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  *base_out = summarize(std::move(ub));
  *out = summarize(std::move(uf));
  return true;
}

nlohmann::json to_json(const Stats& s) {
  return {{"iters", s.iters},
          {"median_us", s.median_us},
          {"mean_us", s.mean_us},
          {"min_us", s.min_us},
          {"max_us", s.max_us}};
}

Table::Table(std::vector<Column> cols) : cols_(std::move(cols)) {
  for (auto& c : cols_) c.width = std::max<int>(c.width, static_cast<int>(c.name.size()));
}

std::string Table::header() const {
  std::string s = "#";
  for (size_t i = 0; i < cols_.size(); ++i)
    s += strprintf("%s%*s", i ? "  " : "", cols_[i].width, cols_[i].name.c_str());
  return s;
}

std::string Table::row(const std::vector<std::string>& cells) const {
  std::string s = " ";
  for (size_t i = 0; i < cols_.size(); ++i)
    s +=
        strprintf("%s%*s", i ? "  " : "", cols_[i].width, i < cells.size() ? cells[i].c_str() : "");
  return s;
}

std::string strprintf(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&s[0], s.size() + 1, fmt, ap2);
  va_end(ap2);
  return s;
}

MachineInfo machine_info() {
  MachineInfo m;
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) == 0) m.host = host;
  m.cpu_model = "unknown";
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        size_t b = line.find_first_not_of(" \t", colon + 1);
        if (b != std::string::npos) m.cpu_model = line.substr(b);
      }
      break;
    }
  }
  m.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  m.usable_cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : m.logical_cpus;
  __builtin_cpu_init();
  m.avx2 = __builtin_cpu_supports("avx2");
  m.f16c = __builtin_cpu_supports("f16c");
  return m;
}

std::vector<Setting> kvxfer_settings() {
  std::vector<Setting> out;
  // A rate is shown as written ("25gbit"), the other kinds as parsed.
#define KVXFER_PARAM_SECTION(title, doc)
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc) \
  out.push_back({env, std::to_string(params::Name()), std::getenv(env) != nullptr});
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc) \
  out.push_back({env, std::to_string(params::Name()), std::getenv(env) != nullptr});
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc) \
  out.push_back({env, strprintf("%g", params::Name()), std::getenv(env) != nullptr});
#define KVXFER_PARAM_RATE(Name, env, def, doc) \
  out.push_back(                               \
      {env, std::getenv(env) != nullptr ? std::getenv(env) : def, std::getenv(env) != nullptr});
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc) \
  out.push_back({env, params::name_of(params::Name()), std::getenv(env) != nullptr});
#define KVXFER_PARAM_STRING(Name, env, def, doc) \
  out.push_back({env, params::Name(), std::getenv(env) != nullptr});
#include "common/params.def"
  return out;
}

void print_preamble(FILE* out, const char* tool, const MachineInfo& m,
                    const std::vector<Setting>& settings) {
  std::fprintf(out, "# %s: kvxfer %d.%d.%d on %s\n", tool, KVXFER_MAJOR, KVXFER_MINOR, KVXFER_PATCH,
               m.host.empty() ? "?" : m.host.c_str());
  std::fprintf(out, "# CPU: %s | %d logical CPUs (%d usable) | AVX2 %s, F16C %s\n",
               m.cpu_model.c_str(), m.logical_cpus, m.usable_cpus, m.avx2 ? "yes" : "no",
               m.f16c ? "yes" : "no");
  std::string s = "# Settings:";
  for (const Setting& x : settings)
    s += " " + x.name + "=" + (x.value.empty() ? std::string("''") : x.value) +
         (x.from_env ? "*" : "");
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (omp != nullptr) s += std::string(" OMP_NUM_THREADS=") + omp + "*";
  s += "  (* = set in the environment, else default)";
  std::fprintf(out, "%s\n", s.c_str());
}

nlohmann::json to_json(const MachineInfo& m) {
  return {{"host", m.host},
          {"cpu_model", m.cpu_model},
          {"logical_cpus", m.logical_cpus},
          {"usable_cpus", m.usable_cpus},
          {"avx2", m.avx2},
          {"f16c", m.f16c}};
}

nlohmann::json to_json(const std::vector<Setting>& s) {
  nlohmann::json j = nlohmann::json::object();
  for (const Setting& x : s) j[x.name] = {{"value", x.value}, {"from_env", x.from_env}};
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (omp != nullptr) j["OMP_NUM_THREADS"] = {{"value", omp}, {"from_env", true}};
  return j;
}

bool write_json_file(const std::string& path, const nlohmann::json& j, std::string* error) {
  std::ofstream f(path);
  if (!f) {
    if (error) *error = "cannot open " + path + " for writing";
    return false;
  }
  f << j.dump(2) << "\n";
  f.close();
  if (!f) {
    if (error) *error = "write to " + path + " failed";
    return false;
  }
  return true;
}

int emit_json(const char* tool, const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return 0;
  std::string err;
  if (!write_json_file(path, j, &err)) {
    std::fprintf(stderr, "%s: %s\n", tool, err.c_str());
    return 2;
  }
  std::printf("# JSON written to %s\n", path.c_str());
  return 0;
}

bool parse_size(const std::string& s, uint64_t* out) {
  std::string why;
  return params::parse_size(s, out, &why);
}

std::vector<uint64_t> size_sweep(uint64_t min, uint64_t max, uint64_t factor) {
  std::vector<uint64_t> out;
  for (uint64_t s = min; s <= max;) {
    out.push_back(s);
    if (factor <= 1 || s > max / factor) break;  // the next step passes max (or overflows)
    s *= factor;
  }
  return out;
}

// ---------------------------------------------------------------------------
// ForkedChild
// ---------------------------------------------------------------------------
ForkedChild::~ForkedChild() { kill(); }

bool ForkedChild::start(const std::function<int()>& body, std::string* error) {
  std::fflush(nullptr);
  parent_ = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    *error = std::string("fork: ") + std::strerror(errno);
    return false;
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);                // never outlive the parent
    if (!parent_alive()) ::_exit(3);                   // it died before prctl took effect
    const int rc = guarded_main("forked peer", body);  // sizes beyond memory: status 2
    std::fflush(stderr);
    ::_exit(rc);
  }
  pid_ = pid;
  status_ = -1;
  reaped_ = false;
  return true;
}

bool ForkedChild::parent_alive() const { return ::getppid() == parent_; }

bool ForkedChild::alive() {
  if (pid_ < 0 || reaped_) return false;
  if (::waitpid(pid_, &status_, WNOHANG) == pid_) reaped_ = true;
  return !reaped_;
}

void ForkedChild::wait() {
  if (pid_ < 0 || reaped_) return;
  ::waitpid(pid_, &status_, 0);
  reaped_ = true;
}

bool ForkedChild::wait_for(double seconds) {
  using clock = std::chrono::steady_clock;
  const auto end = clock::now() + std::chrono::duration<double>(seconds);
  while (alive() && clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (pid_ < 0) return false;
  if (reaped_) return true;
  kill();
  return false;
}

void ForkedChild::kill() {
  if (pid_ < 0 || reaped_) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, &status_, 0);
  reaped_ = true;
}

bool ForkedChild::exited_ok() const {
  return reaped_ && WIFEXITED(status_) && WEXITSTATUS(status_) == 0;
}

std::string ForkedChild::describe() const {
  if (pid_ < 0) return "not started";
  if (!reaped_) return "running";
  if (WIFEXITED(status_)) return "exit code " + std::to_string(WEXITSTATUS(status_));
  if (WIFSIGNALED(status_)) return "killed by signal " + std::to_string(WTERMSIG(status_));
  return "status " + std::to_string(status_);
}

int guarded_main(const char* tool, const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: not enough memory for these sizes (std::bad_alloc)\n", tool);
  } catch (const std::length_error& e) {
    std::fprintf(stderr, "%s: sizes out of range (%s)\n", tool, e.what());
  }
  return 2;
}

uint64_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoull(line.substr(13)) * 1024;
  return 0;
}

long proc_status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(key.size()));
  return -1;
}

}  // namespace kvxfer::perf
