#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/error.h"

using namespace kvlm;

TEST(KVCacheDType, ParsesExactlyTheWhitelist) {
  const std::pair<const char*, KVCacheDType> valid[] = {
      {"auto", KVCacheDType::Auto},
      {"float16", KVCacheDType::Float16},
      {"bfloat16", KVCacheDType::BFloat16},
      {"fp8", KVCacheDType::Fp8},
      {"fp8_e4m3", KVCacheDType::Fp8E4M3},
      {"fp8_e5m2", KVCacheDType::Fp8E5M2},
      {"fp8_per_token_head", KVCacheDType::Fp8PerTokenHead},
      {"int8_per_token_head", KVCacheDType::Int8PerTokenHead},
      {"int4_per_token_head", KVCacheDType::Int4PerTokenHead},
  };
  for (auto [name, d] : valid) {
    EXPECT_EQ(parse_kv_cache_dtype(name), d);
    EXPECT_EQ(kv_cache_dtype_name(d), name);
  }
  EXPECT_EQ(all_kv_cache_dtypes().size(), std::size(valid));
  for (const char* bad : {"fp8_e6m1", "FP8", "bf16", "fp16", "half", "float32", "int4", "q4_0", "fp8_inc", "nvfp4", "", " fp8"})
    EXPECT_THROW(parse_kv_cache_dtype(bad), Error) << bad;
}

TEST(KVCacheDType, ErrorListsEveryValidValue) {
  try {
    parse_kv_cache_dtype("fp8_e6m1");
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'fp8_e6m1'"), std::string::npos);
    for (KVCacheDType d : all_kv_cache_dtypes()) EXPECT_NE(msg.find(std::string(kv_cache_dtype_name(d))), std::string::npos);
  }
}

TEST(KVCacheDType, StorageMeaning) {
  EXPECT_FALSE(kv_storage_of(KVCacheDType::Auto).has_value());
  EXPECT_EQ(*kv_storage_of(KVCacheDType::Fp8), *kv_storage_of(KVCacheDType::Fp8E4M3));  // fp8 means E4M3
  EXPECT_EQ(*kv_storage_of(KVCacheDType::BFloat16), (KVStorage{DType::BF16, KVQuantMode::None}));
  EXPECT_EQ(*kv_storage_of(KVCacheDType::Float16), (KVStorage{DType::F16, KVQuantMode::None}));
  EXPECT_EQ(*kv_storage_of(KVCacheDType::Fp8E5M2), (KVStorage{DType::F8E5M2, KVQuantMode::Fp8PerTensor}));
  EXPECT_EQ(*kv_storage_of(KVCacheDType::Fp8PerTokenHead), (KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTokenHead}));
  EXPECT_EQ(*kv_storage_of(KVCacheDType::Int8PerTokenHead), (KVStorage{DType::I8, KVQuantMode::Int8PerTokenHead}));
  EXPECT_EQ(*kv_storage_of(KVCacheDType::Int4PerTokenHead), (KVStorage{DType::I4, KVQuantMode::Int4PerTokenHead}));
}

TEST(DType, SafetensorsNamesRoundTrip) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F8E4M3, DType::F8E5M2, DType::I8, DType::I32, DType::I64,
                  DType::U8, DType::Bool, DType::F64}) {
    EXPECT_EQ(dtype_from_safetensors(dtype_safetensors_name(t)), t);
  }
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F8E4M3), 1u);
  // int4 is half a byte: only whole bytes of it have a size, and it has no safetensors name.
  EXPECT_EQ(dtype_bits(DType::I4), 4u);
  EXPECT_EQ(dtype_bytes(DType::I4, 128), 64u);
  EXPECT_THROW(dtype_size(DType::I4), std::exception);
  EXPECT_THROW(dtype_bytes(DType::I4, 3), std::exception);
  EXPECT_FALSE(dtype_from_safetensors("").has_value());
  EXPECT_FALSE(dtype_from_safetensors("Q4_K").has_value());
  EXPECT_EQ(dtype_from_torch_name("torch.bfloat16"), DType::BF16);
  EXPECT_EQ(dtype_from_torch_name("half"), DType::F16);
  EXPECT_FALSE(dtype_from_torch_name("int8").has_value());
}
