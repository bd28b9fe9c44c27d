// A dense, row-major tensor that owns (a share of) its storage. Storage comes from an
// Allocator, which records every byte in the owning rank's MemoryLedger by category.
// A view (narrow along dim 0) shares storage and keeps it alive.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/memory_ledger.h"

namespace tpsim {

using Shape = std::vector<std::int64_t>;

std::int64_t shape_numel(const Shape& s);  // throws on negative dims or overflow
std::string shape_str(const Shape& s);     // "[2,64,256]"

enum class DeviceKind { Cpu, Cuda };
struct Device {
  DeviceKind kind = DeviceKind::Cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
};
std::string device_str(Device d);  // "cpu" or "cuda:1"

// Hands out raw bytes for one rank's device and records them in that rank's ledger.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) = 0;
  MemoryLedger& ledger() { return ledger_; }
  const MemoryLedger& ledger() const { return ledger_; }

 private:
  MemoryLedger ledger_;
};

// 64-byte aligned host memory; large buffers on huge pages (core/host_memory.h).
class HostAllocator final : public Allocator {
 public:
  Device device() const override { return {}; }
  void* allocate(std::size_t bytes) override;
  void deallocate(void* p, std::size_t bytes) override;
};

class Tensor {
 public:
  Tensor() = default;  // an empty handle; defined() is false

  // Uninitialised storage from `alloc`, recorded under `category` with `tag`.
  static Tensor empty(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category,
                      std::string tag);
  // Host-only convenience: zero-filled.
  static Tensor zeros(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category,
                      std::string tag);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const { return numel_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  const std::string& tag() const;

  void* raw() const;  // first element of this view
  template <class T>
  T* data() const {
    check_dtype(dtype_of<T>());
    return static_cast<T*>(raw());
  }

  // Rows [start, start+len) of dim 0, sharing storage.
  Tensor narrow0(std::int64_t start, std::int64_t len) const;
  // Same storage, new shape with the same numel.
  Tensor reshape(const Shape& shape) const;

  void check_dtype(DType want) const;  // throws Error naming the tag

 private:
  struct Storage;
  std::shared_ptr<Storage> storage_;
  std::int64_t offset_ = 0;  // in elements
  Shape shape_;
  std::int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

}  // namespace tpsim
