// What the process's CUDA graphs are made of and what the driver does for them, seen through
// a CUPTI callback on every driver API call (loaded by probe_launch.py --graph-inspect; no
// profiler may run beside it, CUPTI takes one subscriber). Calls are counted under the tag the
// caller set last (graph_inspect_tag; a name set again is the same tag). At each graph instantiation it records the graph's nodes
// by type, with child graphs flattened, its edges and its nodes of more than one dependency;
// at each graph launch, the host time the driver took. graph_inspect_report() prints it all as
// lines of JSON on stdout. With GRAPH_INSPECT_DOT_DIR set, each tag's first two instantiated
// graphs are also written there in the driver's verbose DOT form (every node's parameters and
// attributes), as <tag>.<n>.dot. graph_inspect_rebuild(n) takes the last graph instantiated
// under the current tag (a copy kept at its instantiation), instantiates it again and as
// rebuilt variants (child graphs inlined, only the top level's kernels, only the child
// graphs' nodes), launches each n times on a stream of its own with a sync after each, and
// prints the driver's host time per launch: what in a graph costs launch time. The variants
// run the graph's kernels on the buffers it was recorded with, so call it while they are
// alive (right after the step ran). graph_inspect_contexts(n) launches the tag's own graph
// execs (the ones its program instantiated, on the stream it launched them on) n times from
// here, plainly and in the ways its program's launches differ from a tight loop: XLA's event
// wait and host callback around each launch, its two execs in turn, a cold host cache, from
// another thread. The counters are not synchronized: the counts of calls made from
// several threads at once may be a little short.
#include <cuda.h>
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>

#define MAX_TAGS 64
#define MAX_GRAPHS 512
#define NUM_TYPES 14
#define NUM_CBIDS 1024

typedef struct {
  int tag;
  unsigned long long flags;
  long top[NUM_TYPES], flat[NUM_TYPES], edges, joins;
} GraphInfo;

typedef struct {
  char name[64];
  long calls[NUM_CBIDS];
  long launches, launch_ns, launch_max_ns;
} Tag;

static Tag tags[MAX_TAGS];
static GraphInfo graphs[MAX_GRAPHS];
static int current_tag, num_tags = 1, num_graphs, inside;
static long graphs_dropped, tags_dropped;  // past MAX_GRAPHS and MAX_TAGS
static long launch_start;
static CUpti_SubscriberHandle subscriber;

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void count_nodes(CUgraph graph, GraphInfo* info, int depth) {
  size_t n = 0, e = 0;
  cuGraphGetNodes(graph, NULL, &n);
  CUgraphNode* nodes = malloc((n + 1) * sizeof(CUgraphNode));
  cuGraphGetNodes(graph, nodes, &n);
  cuGraphGetEdges(graph, NULL, NULL, NULL, &e);
  info->edges += (long)e;
  for (size_t i = 0; i < n; ++i) {
    CUgraphNodeType type;
    size_t deps = 0;
    cuGraphNodeGetType(nodes[i], &type);
    cuGraphNodeGetDependencies(nodes[i], NULL, NULL, &deps);
    if (deps > 1) info->joins++;
    if (depth == 0 && type < NUM_TYPES) info->top[type]++;
    if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
      CUgraph child;
      cuGraphChildGraphNodeGetGraph(nodes[i], &child);
      count_nodes(child, info, depth + 1);
    } else if (type < NUM_TYPES) {
      info->flat[type]++;
    }
  }
  free(nodes);
}

static int dots_of_tag[MAX_TAGS];
static CUgraph kept[MAX_TAGS];           // a copy of the last graph instantiated per tag
static unsigned long long kept_flags[MAX_TAGS];
static CUgraphExec execs[MAX_TAGS][2];  // the last two execs instantiated per tag
static long num_execs[MAX_TAGS];
static CUstream launched_on[MAX_TAGS];  // the stream of the tag's last graph launch

static void write_dot(CUgraph graph) {
  const char* dir = getenv("GRAPH_INSPECT_DOT_DIR");
  if (!dir || dots_of_tag[current_tag] == 2) return;
  char path[512];
  snprintf(path, sizeof path, "%s/%s.%d.dot", dir, tags[current_tag].name,
           dots_of_tag[current_tag]++);
  for (char* c = path + strlen(dir) + 1; *c; ++c)
    if (*c == ' ' || *c == '=' || *c == '/') *c = '_';
  cuGraphDebugDotPrint(graph, path, CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE);
}

static void instantiated(CUgraph graph, unsigned long long flags) {
  write_dot(graph);
  if (kept[current_tag]) cuGraphDestroy(kept[current_tag]);
  if (cuGraphClone(&kept[current_tag], graph) != CUDA_SUCCESS) kept[current_tag] = NULL;
  kept_flags[current_tag] = flags;
  if (num_graphs == MAX_GRAPHS) {
    graphs_dropped++;
    return;
  }
  GraphInfo* info = &graphs[num_graphs++];
  memset(info, 0, sizeof *info);
  info->tag = current_tag;
  info->flags = flags;
  count_nodes(graph, info, 0);
}

static void CUPTIAPI on_call(void* user, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                             const void* data) {
  (void)user;
  const CUpti_CallbackData* call = data;
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API || inside) return;
  const int launch = cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch ||
                     cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz;
  if (call->callbackSite == CUPTI_API_EXIT) {
    CUgraphExec* made = NULL;
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithFlags)
      made = ((const cuGraphInstantiateWithFlags_params*)call->functionParams)->phGraphExec;
    else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams)
      made = ((const cuGraphInstantiateWithParams_params*)call->functionParams)->phGraphExec;
    if (made) execs[current_tag][num_execs[current_tag]++ % 2] = *made;
    if (launch) {
      Tag* t = &tags[current_tag];
      const long took = now_ns() - launch_start;
      t->launches++;
      t->launch_ns += took;
      if (took > t->launch_max_ns) t->launch_max_ns = took;
    }
    return;
  }
  if (cbid < NUM_CBIDS) tags[current_tag].calls[cbid]++;
  inside = 1;  // the driver calls made here are not the program's
  if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithFlags) {
    const cuGraphInstantiateWithFlags_params* p = call->functionParams;
    instantiated(p->hGraph, p->flags);
  } else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams) {
    const cuGraphInstantiateWithParams_params* p = call->functionParams;
    instantiated(p->hGraph, p->instantiateParams ? p->instantiateParams->flags : 0);
  }
  inside = 0;
  if (launch) {
    launched_on[current_tag] = ((const cuGraphLaunch_params*)call->functionParams)->hStream;
    launch_start = now_ns();
  }
}

// The graph's nodes in an order that respects its edges (Kahn's), into order[0..n).
static size_t topological(CUgraph graph, CUgraphNode** order) {
  size_t n = 0;
  cuGraphGetNodes(graph, NULL, &n);
  CUgraphNode* nodes = malloc((n + 1) * sizeof *nodes);
  size_t* missing = calloc(n + 1, sizeof *missing);
  *order = malloc((n + 1) * sizeof **order);
  cuGraphGetNodes(graph, nodes, &n);
  size_t done = 0;
  for (size_t i = 0; i < n; ++i) {
    cuGraphNodeGetDependencies(nodes[i], NULL, NULL, &missing[i]);
    if (!missing[i]) (*order)[done++] = nodes[i];
  }
  for (size_t k = 0; k < done; ++k) {
    size_t m = 0;
    cuGraphNodeGetDependentNodes((*order)[k], NULL, NULL, &m);
    CUgraphNode* next = malloc((m + 1) * sizeof *next);
    cuGraphNodeGetDependentNodes((*order)[k], next, NULL, &m);
    for (size_t j = 0; j < m; ++j)
      for (size_t i = 0; i < n; ++i)
        if (nodes[i] == next[j] && --missing[i] == 0) (*order)[done++] = nodes[i];
    free(next);
  }
  free(nodes);
  free(missing);
  return done;
}

enum { ALL_FLAT, TOP_KERNELS, CHILDREN_FLAT, CHILDREN_AS_CHILDREN, FLAT_PLAIN_EDGES,
       FLAT_NO_ATTRIBUTES, TOP_THEN_CHILDREN, NUM_VARIANTS };
static const char* variant_names[NUM_VARIANTS] = {
    "flat", "top_kernels_only", "children_flat", "children_as_child_graphs",
    "flat_plain_edges", "flat_plain_edges_no_node_attributes", "top_kernels_then_children"};

typedef struct {
  CUgraph graph;
  int plain_edges, attributes;    // keep no edge's type / copy the kernel nodes' attributes
  CUgraphNode last, last_source;  // the chain's end and the node it was copied from
  long kernels, memsets, children, others;
} Rebuild;

// Appends `node`'s copy to the chain, keeping the type of the edge from the node copied last
// when the original had that edge (FlashMLA's programmatic launches).
static void append(Rebuild* r, CUgraphNode node, CUgraphNode copy) {
  if (r->last) {
    CUgraphEdgeData edge;
    memset(&edge, 0, sizeof edge);
    size_t m = 0;
    cuGraphNodeGetDependencies(node, NULL, NULL, &m);
    CUgraphNode* deps = malloc((m + 1) * sizeof *deps);
    CUgraphEdgeData* data = calloc(m + 1, sizeof *data);
    cuGraphNodeGetDependencies(node, deps, data, &m);
    for (size_t i = 0; i < m && !r->plain_edges; ++i)
      if (deps[i] == r->last_source) edge = data[i];
    free(deps);
    free(data);
    cuGraphAddDependencies(r->graph, &r->last, &copy, &edge, 1);
  }
  r->last = copy;
  r->last_source = node;
}

static void rebuild_from(Rebuild* r, CUgraph graph, int variant, int depth, CUcontext ctx) {
  CUgraphNode* order;
  const size_t n = topological(graph, &order);
  for (size_t i = 0; i < n; ++i) {
    CUgraphNodeType type;
    CUgraphNode copy = NULL;
    cuGraphNodeGetType(order[i], &type);
    const int flat = variant == ALL_FLAT || variant == FLAT_PLAIN_EDGES ||
                     variant == FLAT_NO_ATTRIBUTES;
    const int keep = flat || (variant == TOP_KERNELS && depth == 0) ||
                     (variant != TOP_KERNELS && depth > 0);
    if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
      CUgraph child;
      cuGraphChildGraphNodeGetGraph(order[i], &child);
      if (variant == CHILDREN_AS_CHILDREN) {
        cuGraphAddChildGraphNode(&copy, r->graph, NULL, 0, child);
        r->children++;
      } else if (variant != TOP_KERNELS) {
        rebuild_from(r, child, variant, depth + 1, ctx);
      }
    } else if (!keep) {
    } else if (type == CU_GRAPH_NODE_TYPE_KERNEL) {
      CUDA_KERNEL_NODE_PARAMS p;
      cuGraphKernelNodeGetParams(order[i], &p);
      if (cuGraphAddKernelNode(&copy, r->graph, NULL, 0, &p) == CUDA_SUCCESS) {
        if (r->attributes) cuGraphKernelNodeCopyAttributes(copy, order[i]);
        r->kernels++;
      } else {
        copy = NULL;
      }
    } else if (type == CU_GRAPH_NODE_TYPE_MEMSET) {
      CUDA_MEMSET_NODE_PARAMS p;
      cuGraphMemsetNodeGetParams(order[i], &p);
      cuGraphAddMemsetNode(&copy, r->graph, NULL, 0, &p, ctx);
      r->memsets++;
    } else {
      cuGraphAddEmptyNode(&copy, r->graph, NULL, 0);  // holds the chain's place
      r->others++;
    }
    if (copy) append(r, order[i], copy);
  }
  free(order);
}

static int by_value(const void* a, const void* b) {
  const long x = *(const long*)a, y = *(const long*)b;
  return (x > y) - (x < y);
}

typedef struct {
  CUgraphExec exec[2];
  int num_execs, xla_sequence, cold;
  CUstream stream;
  CUcontext ctx;
  int n, ok;
  long launch_ns, wall_ns;
} Launches;

static void noop(void* data) { (void)data; }

// Median host ns per cuGraphLaunch and per launch-and-sync of l->n launches after 3 warm-ups.
static void* launches(void* arg) {
  Launches* l = arg;
  long* launch = malloc(l->n * sizeof *launch);
  long* wall = malloc(l->n * sizeof *wall);
  const size_t cold_bytes = 256u << 20;
  char* cold = l->cold ? malloc(cold_bytes) : NULL;
  CUstream other;
  CUevent before, after;
  cuCtxSetCurrent(l->ctx);
  cuStreamCreate(&other, CU_STREAM_NON_BLOCKING);
  cuEventCreate(&before, CU_EVENT_DISABLE_TIMING);
  cuEventCreate(&after, CU_EVENT_DISABLE_TIMING);
  l->ok = 1;
  for (int i = -3; l->ok && i < l->n; ++i) {
    if (cold) memset(cold, i & 0xff, cold_bytes);
    if (l->xla_sequence) {  // what XLA does around each launch of its graph
      cuEventRecord(before, other);
      cuStreamWaitEvent(l->stream, before, 0);
    }
    const long start = now_ns();
    l->ok = cuGraphLaunch(l->exec[(i + 3) % l->num_execs], l->stream) == CUDA_SUCCESS;
    const long mid = now_ns();
    if (l->xla_sequence) {
      cuEventRecord(after, l->stream);
      cuLaunchHostFunc(l->stream, noop, NULL);
    }
    l->ok = l->ok && cuStreamSynchronize(l->stream) == CUDA_SUCCESS;
    if (i >= 0) {
      launch[i] = mid - start;
      wall[i] = now_ns() - start;
    }
  }
  if (l->ok) {
    qsort(launch, l->n, sizeof *launch, by_value);
    qsort(wall, l->n, sizeof *wall, by_value);
    l->launch_ns = launch[l->n / 2];
    l->wall_ns = wall[l->n / 2];
  }
  cuEventDestroy(before);
  cuEventDestroy(after);
  cuStreamDestroy(other);
  free(cold);
  free(launch);
  free(wall);
  return NULL;
}

static void print_timed(const char* name, CUgraph graph, unsigned long long flags,
                        CUstream stream, CUcontext ctx, int n, const Rebuild* r) {
  Launches l = {{NULL}, 1, 0, 0, stream, ctx, n, 0, 0, 0};
  size_t nodes = 0;
  cuGraphGetNodes(graph, NULL, &nodes);
  CUresult made = cuGraphInstantiate(&l.exec[0], graph, flags);
  if (made == CUDA_SUCCESS) launches(&l);
  const int ok = made == CUDA_SUCCESS && l.ok;
  printf("%s\"%s\": {\"top_nodes\": %zu", strcmp(name, "as_recorded") ? ", " : "", name, nodes);
  if (r)
    printf(", \"kernels\": %ld, \"memsets\": %ld, \"child_graphs\": %ld, \"others\": %ld",
           r->kernels, r->memsets, r->children, r->others);
  if (ok)
    printf(", \"launch_us\": %.2f, \"wall_us\": %.2f}", l.launch_ns / 1e3, l.wall_ns / 1e3);
  else
    printf(", \"error\": %d}", (int)made);
  if (made == CUDA_SUCCESS) cuGraphExecDestroy(l.exec[0]);
}

// The relaunches' setting: the device's primary context current, a stream of their own, and
// their driver calls not counted as the program's.
static CUstream enter(CUcontext* ctx) {
  CUdevice device;
  CUstream stream;
  inside = 1;
  cuDeviceGet(&device, 0);
  cuDevicePrimaryCtxRetain(ctx, device);
  cuCtxPushCurrent(*ctx);
  cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  return stream;
}

static void leave(CUstream stream, CUcontext ctx) {
  CUdevice device;
  fflush(stdout);
  cuStreamSynchronize(stream);
  cuStreamDestroy(stream);
  cuCtxPopCurrent(&ctx);
  cuDeviceGet(&device, 0);
  cuDevicePrimaryCtxRelease(device);
  inside = 0;
}

void graph_inspect_rebuild(int n) {
  CUgraph graph = kept[current_tag];
  if (!graph || n < 1) return;
  CUcontext ctx;
  const CUstream stream = enter(&ctx);
  printf("{\"rebuilt\": \"%s\", \"flags\": %llu, ", tags[current_tag].name,
         kept_flags[current_tag]);
  print_timed("as_recorded", graph, kept_flags[current_tag], stream, ctx, n, NULL);
  for (int v = 0; v < NUM_VARIANTS; ++v) {
    Rebuild r;
    memset(&r, 0, sizeof r);
    cuGraphCreate(&r.graph, 0);
    r.plain_edges = v == FLAT_PLAIN_EDGES || v == FLAT_NO_ATTRIBUTES;
    r.attributes = v != FLAT_NO_ATTRIBUTES;
    if (v == TOP_THEN_CHILDREN) {  // the same nodes, not interleaved (nor in order)
      rebuild_from(&r, graph, TOP_KERNELS, 0, ctx);
      rebuild_from(&r, graph, CHILDREN_FLAT, 0, ctx);
    } else {
      rebuild_from(&r, graph, v, 0, ctx);
    }
    print_timed(variant_names[v], r.graph, kept_flags[current_tag], stream, ctx, n, &r);
    cuGraphDestroy(r.graph);
  }
  printf("}\n");
  leave(stream, ctx);
}

void graph_inspect_contexts(int n) {
  const int t = current_tag;
  if (!num_execs[t] || !launched_on[t] || n < 1) return;
  CUcontext ctx;
  const CUstream own = enter(&ctx);
  const CUgraphExec last = execs[t][(num_execs[t] - 1) % 2];
  const struct { const char* name; int both, xla_sequence, cold, thread, own_stream; } ways[] = {
      {"own_stream", 0, 0, 0, 0, 1},   {"its_stream", 0, 0, 0, 0, 0},
      {"xla_sequence", 0, 1, 0, 0, 0}, {"both_execs_in_turn", 1, 0, 0, 0, 0},
      {"cold_host_cache", 0, 0, 1, 0, 0}, {"another_thread", 0, 0, 0, 1, 0},
      {"all_of_them", 1, 1, 1, 0, 0}};
  printf("{\"contexts\": \"%s\"", tags[t].name);
  for (size_t w = 0; w < sizeof ways / sizeof ways[0]; ++w) {
    if (ways[w].both && num_execs[t] < 2) continue;
    Launches l = {{last, execs[t][num_execs[t] % 2]}, ways[w].both ? 2 : 1,
                  ways[w].xla_sequence, ways[w].cold, ways[w].own_stream ? own : launched_on[t],
                  ctx, n, 0, 0, 0};
    if (ways[w].thread) {
      pthread_t thread;
      pthread_create(&thread, NULL, launches, &l);
      pthread_join(thread, NULL);
    } else {
      launches(&l);
    }
    if (l.ok)
      printf(", \"%s\": {\"launch_us\": %.2f, \"wall_us\": %.2f}", ways[w].name,
             l.launch_ns / 1e3, l.wall_ns / 1e3);
    else
      printf(", \"%s\": {\"error\": true}", ways[w].name);
  }
  printf("}\n");
  leave(own, ctx);
}

int graph_inspect_start(void) {
  strcpy(tags[0].name, "start");
  if (cuptiSubscribe(&subscriber, (CUpti_CallbackFunc)on_call, NULL) != CUPTI_SUCCESS) return 1;
  return cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API) != CUPTI_SUCCESS;
}

void graph_inspect_tag(const char* name) {
  for (int t = 0; t < num_tags; ++t) {
    if (!strncmp(tags[t].name, name, sizeof tags[0].name - 1)) {  // a tag set again
      current_tag = t;
      return;
    }
  }
  if (num_tags == MAX_TAGS) {
    tags_dropped++;  // counted under the last tag
    return;
  }
  strncpy(tags[num_tags].name, name, sizeof tags[0].name - 1);
  current_tag = num_tags++;
}

static void print_counts(const long* counts, int n) {
  for (int i = 0; i < n; ++i) printf("%s%ld", i ? ", " : "", counts[i]);
}

void graph_inspect_report(void) {
  for (int g = 0; g < num_graphs; ++g) {
    printf("{\"graph\": %d, \"tag\": \"%s\", \"flags\": %llu, \"top\": [", g,
           tags[graphs[g].tag].name, graphs[g].flags);
    print_counts(graphs[g].top, NUM_TYPES);
    printf("], \"flat\": [");
    print_counts(graphs[g].flat, NUM_TYPES);
    printf("], \"edges\": %ld, \"joins\": %ld}\n", graphs[g].edges, graphs[g].joins);
  }
  for (int t = 0; t < num_tags; ++t) {
    printf("{\"tag\": \"%s\", \"launches\": %ld, \"launch_mean_us\": %.2f, "
           "\"launch_max_us\": %.2f, \"calls\": {", tags[t].name, tags[t].launches,
           tags[t].launches ? tags[t].launch_ns / 1e3 / tags[t].launches : 0.0,
           tags[t].launch_max_ns / 1e3);
    int first = 1;
    for (int c = 0; c < NUM_CBIDS; ++c) {
      if (!tags[t].calls[c]) continue;
      const char* name = NULL;
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, (uint32_t)c, &name);
      printf("%s\"%s\": %ld", first ? "" : ", ", name ? name : "?", tags[t].calls[c]);
      first = 0;
    }
    printf("}}\n");
  }
  if (graphs_dropped || tags_dropped)
    printf("{\"graphs_not_recorded\": %ld, \"tags_not_recorded\": %ld}\n", graphs_dropped,
           tags_dropped);
  fflush(stdout);
}
