// The host's time in the CUDA driver calls around a step, without CUPTI (whose callbacks slow
// graph launches ~10x): an LD_PRELOAD library that stands in for a few driver functions,
// timestamps each call's entry and exit (CLOCK_MONOTONIC, the clock of Python's
// time.monotonic_ns) with its thread, and forwards it. It also times the host functions
// enqueued with cuLaunchHostFunc when they run, which tells when the GPU reached them.
// XLA's plugin finds the driver's functions with dlsym on libcuda's handle and torch's
// runtime with cuGetProcAddress, so both are interposed too: a lookup of a traced name gets
// the stand-in. Loaded by probe_launch.py --driver-trace:
//   LD_PRELOAD=/tmp/driver_trace.so python dev/probe_launch.py --driver-trace /tmp/driver_trace.so
// driver_trace_enable(1) starts recording, driver_trace_mark(id) records a mark (id >= 100) on
// the caller's thread, driver_trace_take(buffer, n) copies out up to n records and starts
// over. A record: {t0_ns, t1_ns, tid, fn}; fn indexes driver_trace_names().
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void* P;
typedef void (*HostFn)(void*);

typedef struct {
  int64_t t0, t1;
  int32_t tid, fn;
} Record;

#define CAPACITY (1 << 20)
static Record records[CAPACITY];
static long next_record;
static int enabled;

// The traced functions: X(name, parameter list, argument list). Those of PLAIN get a
// generated stand-in; cuLaunchHostFunc's, which wraps the host function, is written out.
#define TRACED(X)                                                                   \
  X(cuLaunchHostFunc, (P stream, HostFn fn, void* data), (stream, fn, data))        \
  PLAIN(X)
#define PLAIN(X)                                                                    \
  X(cuGraphLaunch, (P exec, P stream), (exec, stream))                              \
  X(cuEventRecord, (P event, P stream), (event, stream))                            \
  X(cuEventRecordWithFlags, (P event, P stream, unsigned f), (event, stream, f))    \
  X(cuStreamWaitEvent, (P stream, P event, unsigned f), (stream, event, f))         \
  X(cuEventSynchronize, (P event), (event))                                         \
  X(cuEventQuery, (P event), (event))                                               \
  X(cuStreamSynchronize, (P stream), (stream))                                      \
  X(cuStreamQuery, (P stream), (stream))                                            \
  X(cuCtxSynchronize, (void), ())                                                   \
  X(cuLaunchKernel, (P f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,       \
                     unsigned by, unsigned bz, unsigned smem, P stream, void** params, \
                     void** extra),                                                 \
    (f, gx, gy, gz, bx, by, bz, smem, stream, params, extra))                       \
  X(cuLaunchKernelEx, (const void* config, P f, void** params, void** extra),       \
    (config, f, params, extra))                                                     \
  X(cuMemcpyHtoDAsync_v2, (uint64_t dst, const void* src, size_t n, P stream),      \
    (dst, src, n, stream))                                                          \
  X(cuMemcpyDtoHAsync_v2, (void* dst, uint64_t src, size_t n, P stream),            \
    (dst, src, n, stream))                                                          \
  X(cuMemcpyDtoDAsync_v2, (uint64_t dst, uint64_t src, size_t n, P stream),         \
    (dst, src, n, stream))                                                          \
  X(cuMemsetD8Async, (uint64_t dst, unsigned char v, size_t n, P stream),           \
    (dst, v, n, stream))                                                            \
  X(cuGraphExecUpdate_v2, (P exec, P graph, void* info), (exec, graph, info))       \
  X(cuGraphInstantiateWithFlags, (P* exec, P graph, unsigned long long f),          \
    (exec, graph, f))                                                               \
  X(cuStreamBeginCapture_v2, (P stream, int mode), (stream, mode))                  \
  X(cuStreamEndCapture, (P stream, P* graph), (stream, graph))                      \
  X(cuCtxPushCurrent_v2, (P ctx), (ctx))                                            \
  X(cuCtxPopCurrent_v2, (P* ctx), (ctx))                                            \
  X(cuCtxSetCurrent, (P ctx), (ctx))                                                \
  X(cuCtxGetCurrent, (P* ctx), (ctx))                                               \
  X(cuEventCreate, (P* event, unsigned f), (event, f))                              \
  X(cuEventDestroy_v2, (P event), (event))

enum {
#define ID(name, params, args) ID_##name,
  TRACED(ID)
#undef ID
  ID_host_function,  // a host function enqueued with cuLaunchHostFunc, as it ran
  NUM_FNS
};

static const char* names[NUM_FNS] = {
#define NAME(name, params, args) #name,
    TRACED(NAME)
#undef NAME
    "host_function"};

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void record(int fn, int64_t t0, int64_t t1) {
  long i = __atomic_fetch_add(&next_record, 1, __ATOMIC_RELAXED);
  if (i < CAPACITY) records[i] = (Record){t0, t1, (int32_t)syscall(SYS_gettid), fn};
}

// The real dlsym: glibc's, by version, since dlsym itself is interposed below.
typedef void* (*DlsymFn)(void*, const char*);
static DlsymFn real_dlsym_fn(void) {
  static DlsymFn fn;
  if (!fn) fn = (DlsymFn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (!fn) fn = (DlsymFn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  return fn;
}

static void* driver_symbol(const char* name) {
  static void* libcuda;
  if (!libcuda) libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  return libcuda ? real_dlsym_fn()(libcuda, name) : NULL;
}

typedef struct {
  HostFn fn;
  void* data;
} HostCall;

static void timed_host_function(void* arg) {
  HostCall call = *(HostCall*)arg;
  free(arg);
  int64_t t0 = now_ns();
  call.fn(call.data);
  if (enabled) record(ID_host_function, t0, now_ns());
}

#define STAND_IN(name, params, args)                                          \
  typedef CUresult(*name##_fn) params;                                        \
  static name##_fn real_##name;                                               \
  CUresult name params {                                                      \
    if (!real_##name) real_##name = (name##_fn)driver_symbol(#name);          \
    if (!real_##name) return 34; /* CUDA_ERROR_STUB_LIBRARY */                \
    if (!enabled) return real_##name args;                                    \
    int64_t t0 = now_ns();                                                    \
    CUresult result = real_##name args;                                       \
    record(ID_##name, t0, now_ns());                                          \
    return result;                                                            \
  }
PLAIN(STAND_IN)
#undef STAND_IN

// The host function enqueued wrapped in one that times it as it runs.
typedef CUresult (*cuLaunchHostFunc_fn)(P, HostFn, void*);
CUresult cuLaunchHostFunc(P stream, HostFn fn, void* data) {
  static cuLaunchHostFunc_fn real;
  if (!real) real = (cuLaunchHostFunc_fn)driver_symbol("cuLaunchHostFunc");
  if (!real) return 34;  // CUDA_ERROR_STUB_LIBRARY
  if (!enabled) return real(stream, fn, data);
  HostCall* call = malloc(sizeof(HostCall));
  if (!call) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  *call = (HostCall){fn, data};
  int64_t t0 = now_ns();
  CUresult result = real(stream, timed_host_function, call);
  record(ID_cuLaunchHostFunc, t0, now_ns());
  if (result != 0) free(call);
  return result;
}

// The stand-in for `name` where `real` is the driver function it forwards to, else NULL.
// cuGetProcAddress takes a base name (cuEventDestroy for cuEventDestroy_v2): a stand-in
// matches a name that is its own or its own less the version suffix.
static void* stand_in(const char* name, void* real) {
#define MATCH(fn, params, args)                                              \
  {                                                                          \
    const char* v = strstr(#fn, "_v2");                                      \
    size_t n = v ? (size_t)(v - #fn) : strlen(#fn);                          \
    int same = strcmp(name, #fn) == 0 || (strncmp(name, #fn, n) == 0 && name[n] == '\0'); \
    if (same && real == driver_symbol(#fn)) return (void*)fn;                \
  }
  TRACED(MATCH)
#undef MATCH
  return NULL;
}

typedef CUresult (*GetProcFn)(const char*, void**, int, uint64_t, int*);
CUresult cuGetProcAddress_v2(const char* name, void** fn, int version, uint64_t flags,
                             int* status) {
  static GetProcFn real;
  if (!real) real = (GetProcFn)driver_symbol("cuGetProcAddress_v2");
  if (!real) return 34;  // CUDA_ERROR_STUB_LIBRARY
  CUresult result = real(name, fn, version, flags, status);
  if (result == 0 && *fn) {
    void* mine = stand_in(name, *fn);
    if (mine) *fn = mine;
  }
  return result;
}

void* dlsym(void* handle, const char* name) {
  void* found = real_dlsym_fn()(handle, name);
  if (!found) return NULL;
  if (strcmp(name, "cuGetProcAddress_v2") == 0) return (void*)cuGetProcAddress_v2;
  void* mine = stand_in(name, found);
  return mine ? mine : found;
}

void driver_trace_enable(int on) { enabled = on; }

void driver_trace_mark(int id) {
  int64_t t = now_ns();
  record(id, t, t);
}

// Copies the first min(n, recorded) records into out and starts over; returns how many were
// recorded (more than n or than the capacity: some were lost).
long driver_trace_take(Record* out, long n) {
  long recorded = __atomic_exchange_n(&next_record, 0, __ATOMIC_ACQ_REL);
  long kept = recorded < CAPACITY ? recorded : CAPACITY;
  memcpy(out, records, (kept < n ? kept : n) * sizeof(Record));
  return recorded;
}

const char* driver_trace_name(int fn) { return fn >= 0 && fn < NUM_FNS ? names[fn] : "?"; }
int driver_trace_num_fns(void) { return NUM_FNS; }
