// Prefix-cache blocks (each [layers, heads, block tokens, head dim], stacked over layers so that a
// block is one array to store) put back together as one buffer per layer.
//
// MLX's concatenate over ~100 blocks, then per-layer views of the result, then the KV cache's
// growth (a copy into a larger buffer) and the batch merge (another) moved the ~70 MB of a
// 1,500-token SmolLM2 prefix four times, ≈1.4 GB/s: most of a cached prompt's time to first
// token. Here each layer's buffer is written once, in parallel, with room for the tokens still
// to come, so the cache grows in place.
#include "assemble.h"


#include <cstring>
#include <stdexcept>

#include "mlx/ops.h"
#include "parallel.h"
#include "threads.h"

namespace mx = mlx::core;

namespace mlxd {

std::vector<mx::array> assemble_kv(const std::vector<mx::array>& blocks, int capacity) {
  if (blocks.empty()) {
    throw std::invalid_argument("assemble_kv: no blocks");
  }
  const auto& first = blocks[0];
  if (first.ndim() != 4) {
    throw std::invalid_argument("assemble_kv: blocks must be [layers, heads, tokens, head dim]");
  }
  const int L = first.shape(0), H = first.shape(1), D = first.shape(3);
  int tokens = 0;
  for (const auto& b : blocks) {
    if (b.ndim() != 4 || b.shape(0) != L || b.shape(1) != H || b.shape(3) != D ||
        b.dtype() != first.dtype()) {
      throw std::invalid_argument("assemble_kv: blocks of different layouts");
    }
    tokens += b.shape(2);
  }
  if (capacity < tokens) {
    throw std::invalid_argument("assemble_kv: capacity below the blocks' tokens");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs;
  inputs.reserve(blocks.size());
  for (const auto& b : blocks) {
    inputs.push_back(mx::contiguous(b, false, stream));
  }
  return mx::array::make_arrays(
      std::vector<mx::Shape>(L, {1, H, capacity, D}),
      std::vector<mx::Dtype>(L, first.dtype()),
      std::make_shared<AssembleKV>(stream),
      inputs);
}

void AssembleKV::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  const int L = inputs[0].shape(0), H = inputs[0].shape(1);
  const size_t row = inputs[0].shape(3) * inputs[0].itemsize();  // bytes of one position
  const size_t capacity = outputs[0].shape(2);
  std::vector<const char*> sources;
  std::vector<int> lengths;
  for (const auto& b : inputs) {
    sources.push_back(b.data<char>());
    lengths.push_back(b.shape(2));
  }
  std::vector<char*> layers;
  for (auto& y : outputs) {
    layers.push_back(y.data<char>());
  }
  encoder.dispatch([=, sources = std::move(sources), lengths = std::move(lengths),
                    layers = std::move(layers),
                    threads = threads_on(stream())]() {
    parallel_for(threads, int64_t(L) * H, [&](int64_t first, int64_t last) {
      for (int64_t head = first; head < last; ++head) {
        const int l = int(head / H), h = int(head % H);
        char* out = layers[l] + h * capacity * row;
        size_t at = 0;
        for (size_t b = 0; b < sources.size(); ++b) {
          const size_t bytes = lengths[b] * row;
          std::memcpy(out + at, sources[b] + (size_t(l) * H + h) * bytes, bytes);
          at += bytes;
        }
        std::memset(out + at, 0, capacity * row - at);
      }
    });
  });
}

}  // namespace mlxd
