#include "cuda/device_block_pool.h"

#include "base/error.h"
#include "cuda/device_buffer.h"

namespace keel::cuda {

DeviceBlockPool::DeviceBlockPool(int device, int64_t block_floats, cudaStream_t stream, int64_t capacity_blocks)
    : BlockAllocator(capacity_blocks), device_(device), block_floats_(block_floats), stream_(stream) {
  if (block_floats < 1) fail(ErrorCode::usage, {}, "a state block holds at least one float");
}

DeviceBlockPool::~DeviceBlockPool() {
  for (float* a : arenas_) cudaFree(a);
}

void DeviceBlockPool::copy_block(int32_t to, int32_t from) const {
  check_api(cudaMemcpyAsync(data(to), data(from), block_bytes(), cudaMemcpyDeviceToDevice, stream_),
            "cudaMemcpyAsync (state block copy)");
}

void DeviceBlockPool::grow_storage(int64_t blocks) {
  while (static_cast<int64_t>(arenas_.size()) * kArenaBlocks < blocks) {
    int current = 0;
    check_api(cudaGetDevice(&current), "cudaGetDevice");
    check_api(cudaSetDevice(device_), "cudaSetDevice");
    float* arena = nullptr;
    const cudaError_t status = cudaMalloc(reinterpret_cast<void**>(&arena), kArenaBlocks * block_bytes());
    cudaSetDevice(current);
    check_api(status, "cudaMalloc (state blocks)");
    arenas_.push_back(arena);
  }
}

}  // namespace keel::cuda
