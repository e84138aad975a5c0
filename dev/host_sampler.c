// A sampling profile of the host: which functions the process's threads spend their CPU time
// in (there is no perf on the GPU machine). Loaded with ctypes by dev/probe_host_profile.py:
// host_sampler_start(interval_us) arms a process CPU-time timer whose SIGPROF lands on a thread
// that is running, and the handler records that thread's id and its stack (backtrace, which
// unwinds by .eh_frame: XLA's code has no frame pointers). host_sampler_stop() disarms it;
// host_sampler_write(path) writes one line a sample, "tid pc pc ...", innermost first, then a
// line "module <load base> <start> <end> <path>" per executable segment, for addr2line to name the PCs by.
//   gcc -shared -fPIC -O2 dev/host_sampler.c -o /tmp/host_sampler.so
#define _GNU_SOURCE
#include <execinfo.h>
#include <link.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#define CAPACITY 65536
#define DEPTH 64

typedef struct {
  int32_t tid, depth;
  void* pcs[DEPTH];
} Sample;

static Sample samples[CAPACITY];
static volatile long taken;

static void on_sigprof(int sig, siginfo_t* info, void* context) {
  (void)sig, (void)info, (void)context;
  long i = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
  if (i >= CAPACITY) return;
  samples[i].tid = (int32_t)syscall(SYS_gettid);
  samples[i].depth = backtrace(samples[i].pcs, DEPTH);
}

static int set_timer(long interval_us) {
  struct itimerval timer = {{interval_us / 1000000, interval_us % 1000000},
                            {interval_us / 1000000, interval_us % 1000000}};
  return setitimer(ITIMER_PROF, &timer, NULL);
}

int host_sampler_start(long interval_us) {
  void* warm[4];
  backtrace(warm, 4);  // loads libgcc's unwinder now, not inside the first signal
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = on_sigprof;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  if (sigaction(SIGPROF, &action, NULL) != 0) return -1;
  taken = 0;
  return set_timer(interval_us);
}

long host_sampler_stop(void) {
  set_timer(0);
  return taken < CAPACITY ? taken : CAPACITY;
}

static int write_module(struct dl_phdr_info* info, size_t size, void* file) {
  (void)size;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)* segment = &info->dlpi_phdr[i];
    if (segment->p_type != PT_LOAD || !(segment->p_flags & PF_X)) continue;
    unsigned long start = info->dlpi_addr + segment->p_vaddr;
    fprintf((FILE*)file, "module %#lx %#lx %#lx %s\n", (unsigned long)info->dlpi_addr, start,
            start + segment->p_memsz, info->dlpi_name[0] ? info->dlpi_name : "main");
  }
  return 0;
}

int host_sampler_write(const char* path) {
  FILE* file = fopen(path, "w");
  if (!file) return -1;
  long n = taken < CAPACITY ? taken : CAPACITY;
  for (long i = 0; i < n; ++i) {
    fprintf(file, "%d", samples[i].tid);
    for (int d = 0; d < samples[i].depth; ++d) fprintf(file, " %p", samples[i].pcs[d]);
    fputc('\n', file);
  }
  dl_iterate_phdr(write_module, file);
  return fclose(file);
}
