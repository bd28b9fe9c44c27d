#include "init/init.h"

#include <algorithm>

namespace tpsim {

namespace {
// out[k] = value at flat index first + k, k < count: normals a pair at a time.
template <class T>
void fill_run(T* out, std::uint64_t seed, std::string_view name, const InitSpec& spec,
              std::int64_t first, std::int64_t count) {
  const std::uint64_t stream = name_hash(name);  // once per run, not once per value
  if (spec.kind == InitSpec::Kind::Uniform) {
    // init_value's formula, element for element (wte: 13M values per model copy)
    const std::uint64_t key = counter_key(seed, stream);
    for (std::int64_t k = 0; k < count; ++k)
      out[k] = static_cast<T>(
          spec.a + (spec.b - spec.a) *
                       uniform_of_bits(counter_bits_at(key, static_cast<std::uint64_t>(first + k))));
    return;
  }
  if (spec.kind != InitSpec::Kind::Normal) {
    for (std::int64_t k = 0; k < count; ++k)
      out[k] = static_cast<T>(init_value(seed, name, spec, first + k));
    return;
  }
  std::int64_t k = 0;
  if (count > 0 && first % 2 == 1) {
    out[k] = static_cast<T>(spec.a * counter_normal(seed, stream, static_cast<std::uint64_t>(first)));
    ++k;
  }
  for (; k + 1 < count; k += 2) {
    double even, odd;
    counter_normal_pair(seed, stream, static_cast<std::uint64_t>(first + k) / 2, even, odd);
    out[k] = static_cast<T>(spec.a * even);
    out[k + 1] = static_cast<T>(spec.a * odd);
  }
  if (k < count)
    out[k] = static_cast<T>(spec.a * counter_normal(seed, stream, static_cast<std::uint64_t>(first + k)));
}
}  // namespace

double init_value(std::uint64_t seed, std::string_view name, const InitSpec& spec,
                  std::int64_t flat_index) {
  const std::uint64_t stream = name_hash(name);
  const auto i = static_cast<std::uint64_t>(flat_index);
  switch (spec.kind) {
    case InitSpec::Kind::Normal: return spec.a * counter_normal(seed, stream, i);
    case InitSpec::Kind::Uniform:
      return spec.a + (spec.b - spec.a) * counter_uniform(seed, stream, i);
    case InitSpec::Kind::Constant: return spec.a;
  }
  return 0.0;
}

template <class T>
void init_block(T* out, std::uint64_t seed, std::string_view name, const InitSpec& spec,
                const Shape& full_shape, int split_dim, std::int64_t offset, std::int64_t length) {
  const int nd = static_cast<int>(full_shape.size());
  if (split_dim < 0) {
    split_dim = 0;
    offset = 0;
    length = nd == 0 ? 1 : full_shape[0];
  }
  if (nd == 0) {
    out[0] = static_cast<T>(init_value(seed, name, spec, 0));
    return;
  }
  if (split_dim >= nd || offset < 0 || length < 0)
    throw Error("init_block(" + std::string(name) + "): bad block dim " +
                std::to_string(split_dim) + " offset " + std::to_string(offset) + " length " +
                std::to_string(length) + " of " + shape_str(full_shape));
  // View the full tensor as [outer, D, inner] with D the split dimension.
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < split_dim; ++d) outer *= full_shape[d];
  for (int d = split_dim + 1; d < nd; ++d) inner *= full_shape[d];
  const std::int64_t D = full_shape[split_dim];
  std::int64_t k = 0;
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = offset; j < offset + length; ++j, k += inner) {
      if (j < D)
        fill_run(out + k, seed, name, spec, (o * D + j) * inner, inner);
      else
        std::fill(out + k, out + k + inner, T(0));  // padding
    }
}

template void init_block<float>(float*, std::uint64_t, std::string_view, const InitSpec&,
                                const Shape&, int, std::int64_t, std::int64_t);
template void init_block<double>(double*, std::uint64_t, std::string_view, const InitSpec&,
                                 const Shape&, int, std::int64_t, std::int64_t);

void init_block(Tensor& out, std::uint64_t seed, std::string_view name, const InitSpec& spec,
                const Shape& full_shape, int split_dim, std::int64_t offset, std::int64_t length) {
  dispatch_float(out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    init_block<T>(out.data<T>(), seed, name, spec, full_shape, split_dim, offset, length);
  });
}

}  // namespace tpsim
