// Arrays whose memory is a file's pages: a cached load maps the kernels' packed weights
// (mlxd/models/packed_cache.py) instead of copying gigabytes into fresh memory.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"

namespace mlxd {

// One array in a file: where its bytes start, its shape and dtype (row-contiguous).
struct FileArray {
  int64_t offset;
  std::vector<int> shape;
  mlx::core::Dtype dtype;
};

// The arrays at `arrays` in the file open at `fd` (named `name` in errors; the caller closes it
// when it likes: the mapping keeps the file), and whether they are its pages (true) or copies
// (false: MLX's allocator is not the CPU one whose buffers this can imitate). The file's eight
// bytes before each array must hold its byte count (what MLX's CPU allocator keeps before a
// buffer); every array must lie inside the file. Mapped copy-on-write: MLX never donates a
// buffer it did not allocate, and a write through a view (numpy's) copies the page it touches,
// so the file stays as it is. Throws std::invalid_argument for a
// file that does not hold these arrays, std::runtime_error when it cannot be read.
std::pair<std::vector<mlx::core::array>, bool> map_arrays(
    int fd, const std::string& name, const std::vector<FileArray>& arrays);

}  // namespace mlxd
