// Probe: when a kernel launched with programmatic dependent launch is captured after a
// join of another stream (cudaStreamWaitEvent), which of its graph edges are
// programmatic? keel's decode attention runs after such a join: the staged key lists are
// copied by a plain kernel on the side stream, joined just before the attention, while
// norm-and-RoPE runs on the stream itself. Were the join's edge a full dependency, the
// lists would be finished and visible when the attention starts, and it could read them
// before griddepcontrol.wait (as the pair products read settled expert ids,
// docs/pending's E); were it programmatic, they would not.
//
// It captures that shape (norm_rope-like and attention-like kernels with the
// programmatic attribute on the stream, a plain copy-like kernel on the side stream,
// the join between) and prints every edge of the graph with its type. Then it replays
// the graph with the side kernel slow (it spins, then writes a flag) and reports what the
// attention-like kernel saw of the flag before its wait and after it, in two forms: the
// side kernel letting dependents start at once, and not at all (as keel's copy kernel);
// then the same launches on the streams, uncaptured. Where the side kernel lets
// dependents start at once, an unset flag before the wait means the join's edge was
// programmatic.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o join_edge join_edge.cu
//   ./join_edge
#include <cuda_runtime.h>

#include <cstdio>
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

// norm-and-RoPE's place: a kernel that lets the next start at once, then waits.
__global__ void before() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The attention's place: the flag from L2 before the wait, and after it.
__global__ void after(const int* flag, int* seen) {
  seen[0] = __ldcg(flag);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  seen[1] = __ldcg(flag);
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
  int *flag, *seen;
  CK(cudaMalloc(&flag, sizeof(int)));
  CK(cudaMalloc(&seen, 2 * sizeof(int)));

  // keel's shape: the flag cleared, the side kernel forked off, the stream's kernel, the
  // join, the attention-like kernel.
  const auto enqueue = [&](bool early) {
    CK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
    CK(cudaEventRecord(fork, stream));
    CK(cudaStreamWaitEvent(side, fork));
    side_copy<<<1, 32, 0, side>>>(flag, early);
    CK(cudaGetLastError());
    launch_overlapped(before, stream);
    CK(cudaEventRecord(join, side));
    CK(cudaStreamWaitEvent(stream, join));
    launch_overlapped(after, stream, static_cast<const int*>(flag), seen);
  };
  // Runs `run` kRuns times, each waited for, and prints how often the flag was unset
  // before and after the wait.
  const auto count_unset = [&](const char* how, const auto& run) {
    constexpr int kRuns = 20;
    int zeros_before = 0, zeros_after = 0;
    for (int r = 0; r < kRuns; ++r) {
      run();
      int host[2];
      CK(cudaMemcpyAsync(host, seen, sizeof(host), cudaMemcpyDeviceToHost, stream));
      CK(cudaStreamSynchronize(stream));
      zeros_before += host[0] == 0;
      zeros_after += host[1] == 0;
    }
    std::printf("  %s: the attention-like kernel saw the flag unset in %d of %d runs before its wait, %d after it\n",
                how, zeros_before, kRuns, zeros_after);
  };

  for (const bool early : {false, true}) {
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue(early);
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
    std::printf("side kernel %s: %zu edges (node: type)\n", early ? "lets dependents start at once" : "never lets them",
                count);
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
    count_unset("streams", [&] { enqueue(early); });
  }
  std::printf("A full edge from the side kernel (type 0, port 0) means the lists are settled at the attention's "
              "start.\n");
  return 0;
}
