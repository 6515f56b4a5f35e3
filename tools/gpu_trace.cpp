// A timeline of one program's GPU work, where Nsight Systems is missing: loaded by the
// CUDA driver into any program (CUDA_INJECTION64_PATH), it records through CUPTI every
// kernel (graph nodes included), copy and memset with its start and end on the GPU, and
// every runtime and driver API call with its start and end on the host, and writes them
// as CSV when the program exits. tools/gpu_timeline.py reads it: where the GPU idles
// within a decode step, and whether the host was late to enqueue what came next.
//
//   g++ -std=c++20 -O2 -shared -fPIC -I$CUDA/include tools/gpu_trace.cpp -L$CUDA/lib64 -lcupti -o libgpu_trace.so
//   (CUDA: the toolkit's root; libcupti's folder on LD_LIBRARY_PATH where it is not found)
//   CUDA_INJECTION64_PATH=$PWD/libgpu_trace.so KEEL_GPU_TRACE=trace.csv keel bench ...
//
// Columns: kind (kernel, memcpy, memset, runtime, driver), start_ns, end_ns, stream,
// correlation (a GPU record's API call has the same), name (the kernel's, the API
// function's, or the copy's bytes). Times are CUPTI's, one clock for host and GPU.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace {

constexpr size_t kBufferBytes = size_t{16} << 20;
std::mutex file_lock;
FILE* out = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = kBufferBytes;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *max_records = 0;
}

const char* api_name(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
  const char* name = nullptr;
  return cuptiGetCallbackName(domain, cbid, &name) == CUPTI_SUCCESS && name ? name : "?";
}

void write(const CUpti_Activity* record) {
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      std::fprintf(out, "kernel,%llu,%llu,%u,%u,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                   k->streamId, k->correlationId, k->name ? k->name : "?");
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      std::fprintf(out, "memcpy,%llu,%llu,%u,%u,%llu bytes kind %u\n", (unsigned long long)m->start,
                   (unsigned long long)m->end, m->streamId, m->correlationId, (unsigned long long)m->bytes,
                   (unsigned)m->copyKind);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      std::fprintf(out, "memset,%llu,%llu,%u,%u,%llu bytes\n", (unsigned long long)m->start, (unsigned long long)m->end,
                   m->streamId, m->correlationId, (unsigned long long)m->bytes);
      break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const bool runtime = record->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      std::fprintf(out, "%s,%llu,%llu,0,%u,%s\n", runtime ? "runtime" : "driver", (unsigned long long)a->start,
                   (unsigned long long)a->end, a->correlationId,
                   api_name(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid));
      break;
    }
    default: break;
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> hold(file_lock);
    CUpti_Activity* record = nullptr;
    while (out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) write(record);
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> hold(file_lock);
  if (out) std::fclose(out);
  out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("KEEL_GPU_TRACE");
  out = std::fopen(path ? path : "gpu_trace.csv", "w");
  if (!out) return 0;
  std::fprintf(out, "kind,start_ns,end_ns,stream,correlation,name\n");
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  for (const CUpti_ActivityKind kind : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                        CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME,
                                        CUPTI_ACTIVITY_KIND_DRIVER}) {
    if (cuptiActivityEnable(kind) != CUPTI_SUCCESS) std::fprintf(stderr, "gpu_trace: activity kind %d refused\n", kind);
  }
  std::atexit(finish);
  return 1;
}
