#include "core/tensor.h"

#include "core/host_memory.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

namespace tpsim {

std::int64_t shape_numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) {
    if (d < 0) throw Error("shape " + shape_str(s) + ": negative dimension");
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d)
      throw Error("shape " + shape_str(s) + ": element count overflows int64");
    n *= d;
  }
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

std::string device_str(Device d) {
  return d.kind == DeviceKind::Cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

void* HostAllocator::allocate(std::size_t bytes) { return allocate_host(bytes); }

void HostAllocator::deallocate(void* p, std::size_t bytes) { free_host(p, bytes); }

struct Tensor::Storage {
  Allocator* alloc;
  void* ptr;
  std::size_t bytes;
  MemCategory category;
  std::string tag;
  Storage(Allocator* a, std::size_t n, MemCategory c, std::string t)
      : alloc(a), ptr(a->allocate(n)), bytes(n), category(c), tag(std::move(t)) {
    alloc->ledger().record_alloc(category, static_cast<std::int64_t>(bytes), tag);
  }
  ~Storage() {
    alloc->ledger().record_free(category, static_cast<std::int64_t>(bytes), tag);
    alloc->deallocate(ptr, bytes);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

Tensor Tensor::empty(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category,
                     std::string tag) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(&alloc, t.nbytes(), category, std::move(tag));
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category,
                     std::string tag) {
  if (alloc.device().kind != DeviceKind::Cpu)
    throw Error("Tensor::zeros(" + tag + "): host-only; use Backend::fill on devices");
  Tensor t = empty(shape, dtype, alloc, category, std::move(tag));
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

std::int64_t Tensor::dim(int i) const {
  int n = ndim();
  int j = i < 0 ? i + n : i;
  if (j < 0 || j >= n)
    throw Error("tensor " + tag() + " " + shape_str(shape_) + ": no dimension " +
                std::to_string(i));
  return shape_[static_cast<std::size_t>(j)];
}

Device Tensor::device() const { return storage_ ? storage_->alloc->device() : Device{}; }

const std::string& Tensor::tag() const {
  static const std::string kUndefined = "<undefined>";
  return storage_ ? storage_->tag : kUndefined;
}

void* Tensor::raw() const {
  if (!storage_) throw Error("Tensor::raw: undefined tensor");
  return static_cast<char*>(storage_->ptr) + offset_ * static_cast<std::int64_t>(dtype_size(dtype_));
}

Tensor Tensor::narrow0(std::int64_t start, std::int64_t len) const {
  if (ndim() == 0 || start < 0 || len < 0 || start + len > shape_[0])
    throw Error("tensor " + tag() + " " + shape_str(shape_) + ": narrow0(" +
                std::to_string(start) + "," + std::to_string(len) + ") out of range");
  Tensor t = *this;
  std::int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  t.offset_ += start * row;
  t.shape_[0] = len;
  t.numel_ = len * row;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (shape_numel(shape) != numel_)
    throw Error("tensor " + tag() + ": cannot reshape " + shape_str(shape_) + " to " +
                shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

void Tensor::check_dtype(DType want) const {
  if (dtype_ != want)
    throw Error("tensor " + tag() + ": dtype is " + dtype_name(dtype_) + ", expected " +
                dtype_name(want));
}

}  // namespace tpsim
