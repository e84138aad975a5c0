"""Does a CUDA graph cost more to launch when its kernels come from many modules, as XLA's do
(it loads a module per fusion) and torch's graph of FlashMLA's decodes does not?

One torch CUDA graph per (nodes, modules): `nodes` launches of a one-block Triton kernel, its
k-th launch from specialization k % modules (each specialization is a module of its own), so
consecutive nodes come from different modules whenever modules > 1. Each: the median over
--steps of the host's time in graph.replay() (dispatch) and until the GPU is done (wall), µs;
with --graph-inspect, the driver's own time per cuGraphLaunch (dev/graph_inspect.c).

  python dev/probe_graph_modules.py --nodes 128,368 --modules 1,128
"""
import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _add(x_ptr, K: tl.constexpr):
    i = tl.program_id(0)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + K)


def graph_of(x, nodes, modules):
    ks = [k % modules for k in range(nodes)]
    for k in range(modules):  # compiled and loaded before the capture
        _add[(1,)](x, K=k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in ks:
            _add[(1,)](x, K=k)
    return graph


def timed(graph, steps):
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
    dispatch, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        graph.replay()
        mid = time.perf_counter()
        torch.cuda.synchronize()
        dispatch.append((mid - start) * 1e6)
        wall.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(dispatch), 1), round(statistics.median(wall), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="128,368", help="graph sizes (default 128,368)")
    parser.add_argument("--modules", default="1,128",
                        help="how many modules the nodes' kernels come from (default 1,128)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--graph-inspect", metavar="LIB", default=None,
                        help="dev/graph_inspect.c built as LIB: the driver's time per launch")
    args = parser.parse_args()
    inspector = None
    if args.graph_inspect:
        from probe_launch import graph_inspector
        inspector = graph_inspector(args.graph_inspect)
    x = torch.zeros(1, device="cuda")
    for nodes in map(int, args.nodes.split(",")):
        for modules in map(int, args.modules.split(",")):
            if inspector:
                inspector.graph_inspect_tag(f"nodes={nodes} modules={modules}".encode())
            graph = graph_of(x, nodes, min(modules, nodes))
            dispatch, wall = timed(graph, args.steps)
            print(json.dumps(dict(nodes=nodes, modules=modules, dispatch_us=dispatch,
                                  wall_us=wall)), flush=True)
            del graph
    if inspector:
        inspector.graph_inspect_report()


if __name__ == "__main__":
    main()
