// Counts the CUDA driver API calls of the process by function, through a CUPTI callback: how
// the GPU tests see what XLA does with its command buffers (a custom call traced into one is
// run under cuStreamBeginCapture; recording one instantiates or updates a CUDA graph; a replay
// only launches it) without reading XLA's log. CUPTI sees every driver call, however the caller
// found the function (XLA's dlsym, the runtime's cuGetProcAddress). Loaded with ctypes by
// tests/gpu_probe.py; one subscriber per process (no profiler beside it).
#include <cupti.h>
#include <stdint.h>

#define NUM_CALLBACK_IDS 4096

static int64_t counts[NUM_CALLBACK_IDS];
static CUpti_SubscriberHandle subscriber;

static void CUPTIAPI on_driver_call(void* userdata, CUpti_CallbackDomain domain,
                                    CUpti_CallbackId id, const void* data) {
  (void)userdata;
  (void)domain;
  const CUpti_CallbackData* call = (const CUpti_CallbackData*)data;
  if (call->callbackSite == CUPTI_API_ENTER && id < NUM_CALLBACK_IDS)
    __atomic_fetch_add(&counts[id], 1, __ATOMIC_RELAXED);
}

// 0 once subscribed to every driver API call; CUPTI's error code otherwise.
int driver_call_counter_start(void) {
  CUptiResult status = cuptiSubscribe(&subscriber, on_driver_call, NULL);
  if (status != CUPTI_SUCCESS) return (int)status;
  return (int)cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API);
}

// Copies the counts since the last take into out[0, n) (indexed by CUPTI's driver callback
// id) and starts counting from zero; returns how many ids there are.
int driver_call_counter_take(int64_t* out, int n) {
  for (int id = 0; id < NUM_CALLBACK_IDS; ++id) {
    int64_t count = __atomic_exchange_n(&counts[id], 0, __ATOMIC_RELAXED);
    if (id < n) out[id] = count;
  }
  return NUM_CALLBACK_IDS;
}

// The driver function of a callback id ("cuGraphLaunch", ...), or NULL.
const char* driver_call_counter_name(int id) {
  const char* name = NULL;
  if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, (uint32_t)id, &name) != CUPTI_SUCCESS)
    return NULL;
  return name;
}
