// Probe: when a kernel launched with programmatic dependent launch is captured after a
// join of another stream (cudaStreamWaitEvent), which of its graph edges are
// programmatic? keel's decode attention can run after such a join: the staged key lists
// are copied by a plain kernel on the side stream, joined just before the attention,
// while norm-and-RoPE runs on the stream itself. Were the join's edge a full dependency,
// the lists would be finished and visible when the attention starts, and it could read
// them before griddepcontrol.wait (as the pair products read settled expert ids); were
// it programmatic, they would not. (keel makes this shape only on the streams: a decode
// graph's piece is flushed before its capture. On an H100 the captured edge printed as
// programmatic, and on the streams the later kernel never saw the write unfinished:
// docs/perf.md, 2026-12-07.)
//
// It captures that shape (norm_rope-like and attention-like kernels with the
// programmatic attribute on the stream, a plain copy-like kernel on the side stream,
// the join between) and prints every edge of the graph with its type. Then it replays
// the graph with the side kernel slow (it spins, then writes a flag) and reports what the
// attention-like kernel saw of the flag before its wait and after it, and whether it
// started while the stream's kernel still ran (the overlap the attribute is for): with
// the side kernel letting dependents start at once, and not at all (as keel's copy
// kernel); then the same launches on the streams, uncaptured. Where the side kernel lets
// dependents start at once, an unset flag before the wait means the join's edge was
// programmatic.
//
// A last form sets the edges by hand while capturing: after the join, the stream's
// capture dependencies are replaced by the same nodes with a programmatic edge from the
// stream's kernel and a full one from the side kernel, and the attention-like kernel
// is launched without the attribute (which would make every edge programmatic). Its
// edges and counts say whether such a graph keeps the stream's overlap and settles the
// side kernel's writes (docs/pending/README.md, C).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o join_edge join_edge.cu
//   ./join_edge
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "check.cuh"

__device__ void spin_ns(unsigned long long ns) {
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (unsigned long long now = start; now - start < ns;) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
}

// The side stream's copy: waits 50 us, then writes the flag (early: lets dependents start first).
__global__ void side_copy(int* flag, bool early) {
  if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  spin_ns(50'000);
  *flag = 1;
}

// norm-and-RoPE's place: a kernel that lets the next start at once, waits, then takes
// 20 us before it sets its mark.
__global__ void before(int* mark) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  spin_ns(20'000);
  *mark = 1;
}

// The attention's place: the flag from L2 before the wait, and after it; and the stream
// kernel's mark before the wait (unset: it started while the stream kernel ran).
__global__ void after(const int* flag, const int* mark, int* seen) {
  seen[0] = __ldcg(flag);
  seen[2] = __ldcg(mark);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  seen[1] = __ldcg(flag);
}

// The nodes the next node captured on `stream` will depend on.
std::vector<cudaGraphNode_t> captured_dependencies(cudaStream_t stream) {
  cudaStreamCaptureStatus status;
  const cudaGraphNode_t* nodes = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t count = 0;
  CK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &nodes, &edges, &count));
  return {nodes, nodes + count};
}

// The node just captured on `stream` (its only dependency for the next node).
cudaGraphNode_t last_captured(cudaStream_t stream) {
  const std::vector<cudaGraphNode_t> nodes = captured_dependencies(stream);
  if (nodes.size() != 1) {
    std::printf("expected one capture dependency, found %zu\n", nodes.size());
    std::exit(1);
  }
  return nodes[0];
}

template <typename... Args>
void launch_overlapped(void (*kernel)(Args...), cudaStream_t stream, Args... args) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = 1;
  config.blockDim = 32;
  config.stream = stream;
  config.attrs = &overlap;
  config.numAttrs = 1;
  CK(cudaLaunchKernelEx(&config, kernel, args...));
}

int main() {
  cudaStream_t stream, side;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  int *flag, *mark, *seen;
  CK(cudaMalloc(&flag, sizeof(int)));
  CK(cudaMalloc(&mark, sizeof(int)));
  CK(cudaMalloc(&seen, 3 * sizeof(int)));

  // keel's shape: the flag cleared, the side kernel forked off, the stream's kernel, the
  // join, the attention-like kernel.
  // by_hand (capturing only): the join's edges set as the third form above says.
  const auto enqueue = [&](bool early, bool by_hand = false) {
    CK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
    CK(cudaMemsetAsync(mark, 0, sizeof(int), stream));
    CK(cudaEventRecord(fork, stream));
    CK(cudaStreamWaitEvent(side, fork));
    side_copy<<<1, 32, 0, side>>>(flag, early);
    CK(cudaGetLastError());
    launch_overlapped(before, stream, mark);
    cudaGraphNode_t before_node = nullptr;
    if (by_hand) before_node = last_captured(stream);
    CK(cudaEventRecord(join, side));
    CK(cudaStreamWaitEvent(stream, join));
    if (!by_hand) return launch_overlapped(after, stream, static_cast<const int*>(flag), static_cast<const int*>(mark), seen);
    std::vector<cudaGraphNode_t> nodes = captured_dependencies(stream);
    std::vector<cudaGraphEdgeData> edges(nodes.size());  // zeroed: full edges
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i] != before_node) continue;
      edges[i].type = cudaGraphDependencyTypeProgrammatic;
      edges[i].from_port = cudaGraphKernelNodePortProgrammatic;
    }
    CK(cudaStreamUpdateCaptureDependencies(stream, nodes.data(), edges.data(), nodes.size(),
                                           cudaStreamSetCaptureDependencies));
    after<<<1, 32, 0, stream>>>(flag, mark, seen);
    CK(cudaGetLastError());
  };
  // Runs `run` kRuns times, each waited for, and prints how often the flag was unset
  // before and after the wait, and how often the stream kernel's mark was (an overlap).
  const auto count_unset = [&](const char* how, const auto& run) {
    constexpr int kRuns = 20;
    int zeros_before = 0, zeros_after = 0, overlapped = 0;
    for (int r = 0; r < kRuns; ++r) {
      run();
      int host[3];
      CK(cudaMemcpyAsync(host, seen, sizeof(host), cudaMemcpyDeviceToHost, stream));
      CK(cudaStreamSynchronize(stream));
      zeros_before += host[0] == 0;
      zeros_after += host[1] == 0;
      overlapped += host[2] == 0;
    }
    std::printf("  %s: the attention-like kernel saw the flag unset in %d of %d runs before its wait, %d after it; "
                "it started while the stream kernel ran in %d\n",
                how, zeros_before, kRuns, zeros_after, overlapped);
  };

  for (const std::pair<bool, bool> form : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    const bool early = form.first, by_hand = form.second;
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue(early, by_hand);
    CK(cudaStreamEndCapture(stream, &graph));

    size_t count = 0;
    CK(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &count));
    std::vector<cudaGraphNode_t> from(count), to(count);
    std::vector<cudaGraphEdgeData> data(count);
    CK(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &count));
    std::vector<cudaGraphNode_t> nodes;  // numbered in the order first met
    const auto number = [&](cudaGraphNode_t n) {
      for (size_t i = 0; i < nodes.size(); ++i) {
        if (nodes[i] == n) return static_cast<int>(i);
      }
      nodes.push_back(n);
      return static_cast<int>(nodes.size() - 1);
    };
    std::printf("side kernel %s, edges %s: %zu edges (node: type)\n",
                early ? "lets dependents start at once" : "never lets them",
                by_hand ? "set by hand" : "from the launch attribute", count);
    for (size_t i = 0; i < count; ++i) {
      cudaGraphNodeType a, b;
      CK(cudaGraphNodeGetType(from[i], &a));
      CK(cudaGraphNodeGetType(to[i], &b));
      std::printf("  node %d (type %d) -> node %d (type %d): edge type %d (%s), from port %d\n", number(from[i]),
                  static_cast<int>(a), number(to[i]), static_cast<int>(b), data[i].type,
                  data[i].type == cudaGraphDependencyTypeProgrammatic ? "programmatic" : "full",
                  data[i].from_port);
    }

    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    count_unset("graph", [&] { CK(cudaGraphLaunch(exec, stream)); });
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    // The same launches on the streams, not captured (keel's eager steps and prefill).
    if (!by_hand) count_unset("streams", [&] { enqueue(early); });
  }
  std::printf("A full edge from the side kernel (type 0, port 0) means the lists are settled at the attention's "
              "start.\n");
  return 0;
}
