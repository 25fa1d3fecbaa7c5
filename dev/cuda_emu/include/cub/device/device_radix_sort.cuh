// cub::DeviceRadixSort for the CPU emulation: the sizing call (null temporary storage) reports a
// size; the sort checks that every pointer lies in device memory with room for num_items, that
// the temporary storage is as large as reported (and scribbles over it, as the real sort uses
// it), then sorts on the host: stable, on bits [begin_bit, end_bit) of the key with signed keys
// ordered as numbers (CUB flips their sign bit first), so equal keys keep their input order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cuda_runtime_api.h"

namespace llmtrain_emu {
/// False (after printing why) unless [pointer, pointer + bytes) lies in one device allocation.
bool check_device_range(const void* pointer, std::size_t bytes, const char* what);
/// False (after printing why) unless `stream` is a valid stream handle.
bool check_stream(cudaStream_t stream, const char* what);
}  // namespace llmtrain_emu

namespace cub {

struct DeviceRadixSort {
  template <class KeyT>
  static std::size_t temp_bytes(std::size_t n) {
    return 2 * n * sizeof(KeyT) + 1024;
  }
  template <class KeyT>
  static std::uint64_t radix_key(KeyT key, int begin_bit, int end_bit) {
    static_assert(std::is_integral_v<KeyT> || std::is_floating_point_v<KeyT>, "integer or float keys");
    std::uint64_t bits = 0;
    std::memcpy(&bits, &key, sizeof key);
    constexpr int width = int(sizeof(KeyT)) * 8;
    constexpr std::uint64_t sign = std::uint64_t(1) << (width - 1);
    if constexpr (std::is_floating_point_v<KeyT>) {
      bits = (bits & sign) ? ~bits : bits ^ sign;
    } else if constexpr (std::is_signed_v<KeyT>) {
      bits ^= sign;
    }
    if (width < 64) bits &= (std::uint64_t(1) << width) - 1;
    const std::uint64_t field = end_bit - begin_bit >= 64 ? ~std::uint64_t(0)
                                                          : (std::uint64_t(1) << (end_bit - begin_bit)) - 1;
    return (bits >> begin_bit) & field;
  }

  template <class KeyT, class ValueT, class NumItemsT>
  static cudaError_t SortPairs(void* d_temp_storage, std::size_t& temp_storage_bytes, const KeyT* d_keys_in,
                               KeyT* d_keys_out, const ValueT* d_values_in, ValueT* d_values_out,
                               NumItemsT num_items, int begin_bit = 0, int end_bit = sizeof(KeyT) * 8,
                               cudaStream_t stream = nullptr) {
    const std::size_t n = num_items > 0 ? std::size_t(num_items) : 0;
    if (!llmtrain_emu::check_stream(stream, "cub::DeviceRadixSort::SortPairs")) return cudaErrorInvalidResourceHandle;
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = temp_bytes<KeyT>(n);
      return cudaSuccess;
    }
    if (begin_bit < 0 || end_bit > int(sizeof(KeyT) * 8) || begin_bit >= end_bit) return cudaErrorInvalidValue;
    if (temp_storage_bytes < temp_bytes<KeyT>(n) ||
        !llmtrain_emu::check_device_range(d_temp_storage, temp_storage_bytes, "SortPairs temporary storage") ||
        !llmtrain_emu::check_device_range(d_keys_in, n * sizeof(KeyT), "SortPairs keys in") ||
        !llmtrain_emu::check_device_range(d_keys_out, n * sizeof(KeyT), "SortPairs keys out") ||
        !llmtrain_emu::check_device_range(d_values_in, n * sizeof(ValueT), "SortPairs values in") ||
        !llmtrain_emu::check_device_range(d_values_out, n * sizeof(ValueT), "SortPairs values out")) {
      return cudaErrorInvalidValue;
    }
    std::vector<KeyT> keys(d_keys_in, d_keys_in + n);
    std::vector<ValueT> values(d_values_in, d_values_in + n);
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return radix_key(keys[a], begin_bit, end_bit) < radix_key(keys[b], begin_bit, end_bit);
    });
    std::memset(d_temp_storage, 0xff, temp_storage_bytes);
    for (std::size_t i = 0; i < n; ++i) {
      d_keys_out[i] = keys[order[i]];
      d_values_out[i] = values[order[i]];
    }
    return cudaSuccess;
  }

  template <class KeyT, class NumItemsT>
  static cudaError_t SortKeys(void* d_temp_storage, std::size_t& temp_storage_bytes, const KeyT* d_keys_in,
                              KeyT* d_keys_out, NumItemsT num_items, int begin_bit = 0,
                              int end_bit = sizeof(KeyT) * 8, cudaStream_t stream = nullptr) {
    const std::size_t n = num_items > 0 ? std::size_t(num_items) : 0;
    if (!llmtrain_emu::check_stream(stream, "cub::DeviceRadixSort::SortKeys")) return cudaErrorInvalidResourceHandle;
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = temp_bytes<KeyT>(n);
      return cudaSuccess;
    }
    if (temp_storage_bytes < temp_bytes<KeyT>(n) ||
        !llmtrain_emu::check_device_range(d_temp_storage, temp_storage_bytes, "SortKeys temporary storage") ||
        !llmtrain_emu::check_device_range(d_keys_in, n * sizeof(KeyT), "SortKeys keys in") ||
        !llmtrain_emu::check_device_range(d_keys_out, n * sizeof(KeyT), "SortKeys keys out")) {
      return cudaErrorInvalidValue;
    }
    std::vector<KeyT> keys(d_keys_in, d_keys_in + n);
    std::stable_sort(keys.begin(), keys.end(), [&](KeyT a, KeyT b) {
      return radix_key(a, begin_bit, end_bit) < radix_key(b, begin_bit, end_bit);
    });
    std::memset(d_temp_storage, 0xff, temp_storage_bytes);
    std::copy(keys.begin(), keys.end(), d_keys_out);
    return cudaSuccess;
  }
};

}  // namespace cub
