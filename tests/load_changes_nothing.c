/* Loading libkvxfer.so changes nothing in the process: no environment
 * variable is set and no signal disposition is replaced.  The program runs
 * itself again through execv with SIGINT and SIGTERM ignored (an ignored
 * signal survives exec, as in a background job of a script), SIGSEGV at its
 * default, and no FI_OFI_RXM_* variable; the second run finds them so in
 * main(), after libkvxfer.so and the libraries under it were loaded.
 *
 * Linked against libkvxfer.so only, calling nothing of the transport.
 * Exit status 0: unchanged; 1: something changed (printed); 2: setup failed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvxfer/kvxfer.h"

static const char* const kVars[] = {"FI_OFI_RXM_MSG_RX_SIZE", "FI_OFI_RXM_BUFFER_SIZE",
                                    "FI_OFI_RXM_EAGER_LIMIT"};
static const struct {
  int sig;
  const char* name;
  void (*expected)(int);
} kSignals[] = {
    {SIGINT, "SIGINT", SIG_IGN}, {SIGTERM, "SIGTERM", SIG_IGN}, {SIGSEGV, "SIGSEGV", SIG_DFL}};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* AddressSanitizer installs its own SIGSEGV handler: that one is not checked. */
#if defined(__SANITIZE_ADDRESS__)
#define ASAN_HANDLES_SIGSEGV 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ASAN_HANDLES_SIGSEGV 1
#endif
#endif
#ifndef ASAN_HANDLES_SIGSEGV
#define ASAN_HANDLES_SIGSEGV 0
#endif

static int check(void) {
  int changed = 0;
  /* The library is loaded: a symbol of it resolves into libkvxfer. */
  Dl_info info;
  if (dladdr((void*)&kvxfer_get_error_string, &info) == 0 || info.dli_fname == NULL ||
      strstr(info.dli_fname, "libkvxfer.so") == NULL) {
    fprintf(stderr, "kvxfer_get_error_string is not from libkvxfer.so\n");
    return 2;
  }
  if (strcmp(kvxfer_get_error_string(KVXFER_SUCCESS), "") == 0) return 2;
  for (size_t i = 0; i < COUNT(kVars); ++i) {
    const char* v = getenv(kVars[i]);
    if (v != NULL) {
      fprintf(stderr, "%s=%s was set while loading\n", kVars[i], v);
      changed = 1;
    }
  }
  for (size_t i = 0; i < COUNT(kSignals); ++i) {
    if (ASAN_HANDLES_SIGSEGV && kSignals[i].sig == SIGSEGV) continue;
    struct sigaction sa;
    if (sigaction(kSignals[i].sig, NULL, &sa) != 0) return 2;
    const int siginfo = (sa.sa_flags & SA_SIGINFO) != 0;
    if (siginfo || sa.sa_handler != kSignals[i].expected) {
      void* fn = siginfo ? (void*)sa.sa_sigaction : (void*)sa.sa_handler;
      Dl_info where;
      const char* lib = dladdr(fn, &where) != 0 && where.dli_fname != NULL ? where.dli_fname : "?";
      fprintf(stderr, "%s: disposition %p (%s), expected %s\n", kSignals[i].name, fn, lib,
              kSignals[i].expected == SIG_IGN ? "SIG_IGN" : "SIG_DFL");
      changed = 1;
    }
  }
  if (!changed) printf("loading libkvxfer.so changed no variable and no disposition\n");
  return changed;
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "--check") == 0) return check();
  for (size_t i = 0; i < COUNT(kVars); ++i) unsetenv(kVars[i]);
  for (size_t i = 0; i < COUNT(kSignals); ++i) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kSignals[i].expected;
    sigemptyset(&sa.sa_mask);
    if (sigaction(kSignals[i].sig, &sa, NULL) != 0) return 2;
  }
  const pid_t pid = fork();
  if (pid < 0) return 2;
  if (pid == 0) {
    char* const args[] = {argv[0], (char*)"--check", NULL};
    execv("/proc/self/exe", args);
    _exit(2);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return 2;
  if (!WIFEXITED(status)) {
    fprintf(stderr, "the check died of signal %d\n", WTERMSIG(status));
    return 1;
  }
  return WEXITSTATUS(status);
}
