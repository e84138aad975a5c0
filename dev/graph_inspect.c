// What the process's CUDA graphs are made of and what the driver does for them, seen through
// a CUPTI callback on every driver API call (loaded by probe_launch.py --graph-inspect; no
// profiler may run beside it, CUPTI takes one subscriber). Calls are counted under the tag the
// caller set last (graph_inspect_tag). At each graph instantiation it records the graph's nodes
// by type, with child graphs flattened, its edges and its nodes of more than one dependency;
// at each graph launch, the host time the driver took. graph_inspect_report() prints it all as
// lines of JSON on stdout. With GRAPH_INSPECT_DOT_DIR set, each tag's first two instantiated
// graphs are also written there in the driver's verbose DOT form (every node's parameters and
// attributes), as <tag>.<n>.dot. The counters are not synchronized: the counts of calls made from
// several threads at once may be a little short.
#include <cuda.h>
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
  if (launch) launch_start = now_ns();
}

int graph_inspect_start(void) {
  strcpy(tags[0].name, "start");
  if (cuptiSubscribe(&subscriber, (CUpti_CallbackFunc)on_call, NULL) != CUPTI_SUCCESS) return 1;
  return cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API) != CUPTI_SUCCESS;
}

void graph_inspect_tag(const char* name) {
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
