#include "mapped.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "mlx/allocator.h"

namespace mlxd {

namespace {

namespace allocator = mlx::core::allocator;

// A file's pages, unmapped when the last array over them goes.
class Mapping {
 public:
  Mapping(void* base, size_t size) : base_(base), size_(size) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { munmap(base_, size_); }
  char* base() const { return static_cast<char*>(base_); }
  size_t size() const { return size_; }

 private:
  void* base_;
  size_t size_;
};

[[noreturn]] void fail(const std::string& what, const std::string& name) {
  throw std::runtime_error(what + " " + name + ": " + std::strerror(errno));
}

// The whole file open at `fd` (the caller keeps and closes it), `name` for messages.
std::shared_ptr<Mapping> map_file(int fd, const std::string& name) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    fail("cannot stat", name);
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    throw std::invalid_argument("empty file " + name);
  }
  // Private and writable: a write copies the page, the file never changes.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (base == MAP_FAILED) {
    fail("cannot map", name);
  }
  auto mapping = std::make_shared<Mapping>(base, size);
#ifdef MADV_POPULATE_READ
  // The pages the page cache holds, mapped now, in one call (≈0.02 s for 6 GiB where a copy
  // took 3–6 s): the first request does not fault them in one by one. Linux ≥ 5.14.
  if (madvise(base, size, MADV_POPULATE_READ) == 0) {
    return mapping;
  }
#endif
  madvise(base, size, MADV_WILLNEED);  // read ahead, at least
  return mapping;
}

// MLX's CPU allocator (mlx/backend/no_gpu/allocator.cpp) keeps each buffer's byte count in the
// size_t before the memory it hands out: Buffer::ptr() is that count's address, raw_ptr() the
// memory's. A Buffer over a file whose bytes are laid out so is what the allocator would have
// made, with a deleter of ours instead of its free. Checked on a buffer it makes; Metal's and
// CUDA's buffers are objects, not such pointers, and there the arrays are copied instead.
bool allocator_keeps_size_before_memory() {
  static const bool keeps = [] {
    constexpr size_t kProbe = 4096;
    allocator::Data data = allocator::malloc(kProbe);
    allocator::Buffer buffer = data.buffer();
    auto* base = static_cast<char*>(buffer.ptr());
    return base != nullptr && static_cast<char*>(buffer.raw_ptr()) == base + sizeof(size_t) &&
        allocator::allocator().size(buffer) >= kProbe &&
        allocator::allocator().size(buffer) == *reinterpret_cast<const size_t*>(base);
  }();
  return keeps;
}

size_t byte_count(const FileArray& array) {
  size_t bytes = array.dtype.size();
  for (int dim : array.shape) {
    if (dim < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(dim), &bytes)) {
      throw std::invalid_argument("an array's shape is not one of a file's");
    }
  }
  return bytes;
}

}  // namespace

std::pair<std::vector<mlx::core::array>, bool> map_arrays(
    int fd, const std::string& name, const std::vector<FileArray>& arrays) {
  const std::shared_ptr<Mapping> mapping = map_file(fd, name);
  const bool mapped = allocator_keeps_size_before_memory();
  std::vector<mlx::core::array> out;
  out.reserve(arrays.size());
  for (const FileArray& array : arrays) {
    const size_t bytes = byte_count(array);
    const auto offset = static_cast<size_t>(array.offset);
    if (array.offset < static_cast<int64_t>(sizeof(size_t)) || offset % sizeof(size_t) != 0 ||
        offset > mapping->size() || bytes > mapping->size() - offset) {
      throw std::invalid_argument("an array outside the file " + name);
    }
    char* memory = mapping->base() + offset;
    size_t stored;
    std::memcpy(&stored, memory - sizeof(size_t), sizeof(size_t));
    if (stored != bytes) {
      throw std::invalid_argument("an array's byte count is not before it in " + name);
    }
    mlx::core::Shape shape(array.shape.begin(), array.shape.end());
    if (mapped) {
      allocator::Data data(
          allocator::Buffer(memory - sizeof(size_t)), [mapping](allocator::Buffer) {});
      out.emplace_back(std::move(data), std::move(shape), array.dtype);
    } else {
      mlx::core::array copy(allocator::malloc(bytes), std::move(shape), array.dtype);
      std::memcpy(copy.data<char>(), memory, bytes);
      out.push_back(std::move(copy));
    }
  }
  return {std::move(out), mapped};
}

}  // namespace mlxd
