// A crash in a process that uses kvxfer dies by its signal.
//
// Debian's libfabric links libpsm_infinipath (and libpsm2).  When
// libinfinipath.so.4 loads, its constructor installs handlers for SIGINT,
// SIGILL, SIGABRT, SIGBUS, SIGSEGV and SIGTERM that print a backtrace, write a
// `*.btr` file into the working directory and exit with status 1: a NULL
// dereference then looks like an ordinary failure to a parent, a test runner
// or a core-dump collector, and Ctrl-C prints a backtrace.  IPATH_NO_BACKTRACE
// and HFI_BACKTRACE only help when set before the library loads.
#pragma once

#include <signal.h>

namespace kvxfer::transport {

/** The signals restore_crash_signals() looks at: SIGINT, SIGILL, SIGABRT,
 *  SIGBUS, SIGFPE, SIGSEGV and SIGTERM. */
constexpr int kCrashSignalCount = 7;

/** The dispositions of those signals at one moment (a copy; no ownership). */
struct CrashSignalDispositions {
  struct sigaction action[kCrashSignalCount];
  bool have[kCrashSignalCount];
  /** Reads them now with sigaction (thread-safe). */
  static CrashSignalDispositions now();
};

/**
 * For every crash signal whose handler lives in libinfinipath or libpsm*
 * (found with dladdr), puts back its disposition in `before` (when given and
 * not itself such a handler), else SIG_DFL.  A handler the application
 * installed, or any other library's, is left alone.  Returns how many
 * dispositions were changed.
 *
 * Runs when libfabric is loaded (fabric_lib::load, with the dispositions from
 * before the dlopen) and after every Domain::open (a provider may install
 * handlers when it initialises).  Thread-safe (sigaction is).  Logs nothing.
 */
int restore_crash_signals(const CrashSignalDispositions* before = nullptr);

/**
 * Keeps the dispositions of SIGINT and SIGTERM across its scope.  libfabric
 * 1.17's shm provider installs handlers for SIGINT, SIGTERM, SIGSEGV and
 * SIGBUS on its first endpoint: they unlink every shm region of the process,
 * then re-raise with the handler they replaced.  A server that handles
 * SIGTERM to drain, or a Python program that catches KeyboardInterrupt,
 * would go on with its regions gone and its same-host peers would fail their
 * links.  The destructor puts back each of the two that changed (the
 * surviving peer of a killed process removes its regions instead).  The
 * crash handlers stay: they clean up, then the process dies by its signal.
 * Not thread-safe against other sigaction calls made meanwhile.
 */
class KeepSignalDispositions {
 public:
  KeepSignalDispositions();
  ~KeepSignalDispositions();
  KeepSignalDispositions(const KeepSignalDispositions&) = delete;
  KeepSignalDispositions& operator=(const KeepSignalDispositions&) = delete;

 private:
  static constexpr int kCount = 2;
  struct sigaction saved_[kCount];
  bool have_[kCount];
};

}  // namespace kvxfer::transport
