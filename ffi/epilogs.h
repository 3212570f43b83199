// The one table of epilog facts on the C++ side: for each public epilog its value, its
// name, cuBLASLt's epilogue, and which buffers it reads and writes besides a, b and y.
// Decoding a call, building a plan and autotuning all read this table (the Python side
// has its own, jax_epilog/epilogs.py). Adding an epilog is one row here.
#ifndef JAX_EPILOG_FFI_EPILOGS_H_
#define JAX_EPILOG_FFI_EPILOGS_H_

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

namespace jax_epilog {

// Element types, numbered as support_query's dtype arguments.
enum class DType : uint8_t { kF16 = 0, kBF16 = 1, kF32 = 2, kE4M3 = 3, kE5M2 = 4 };
constexpr int kDTypeCount = 5;

inline bool IsFp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }
inline size_t ElementBytes(DType t) { return t == DType::kF32 ? 4 : IsFp8(t) ? 1 : 2; }
inline cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kE4M3:
      return CUDA_R_8F_E4M3;
    case DType::kE5M2:
      return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}
// The type of the floating aux arrays (bias, GELU pre-activation, bias gradients) of a
// call whose result y has type `y`: y's own when 16/32-bit, bfloat16 when y is FP8
// (SPEC §5; Python's epilogs.aux_dtype). It is also the type of an FP8 y's C matrix:
// cuBLASLt has no FP8 C type.
inline DType AuxDType(DType y) { return IsFp8(y) ? DType::kBF16 : y; }

// An epilog's aux matrix, (batch, M, AuxRow(aux, N)) row-major: the ReLU bit mask
// (uint8, cuBLASLt's column-major N x M bit matrix with a leading dimension of
// 128*ceil(N/128) bits) or the GELU pre-activation (AuxDType(y), leading dimension
// 8*ceil(N/8) elements); cuBLASLt requires both leading dimensions.
enum class Aux : uint8_t { kNone, kRelu, kGelu };

inline int64_t AuxRow(Aux aux, int64_t n) {
  return aux == Aux::kRelu ? 16 * ((n + 127) / 128) : 8 * ((n + 7) / 8);
}
// `y` is the result's type (the GELU buffer has AuxDType(y)).
inline size_t AuxElementBytes(Aux aux, DType y) {
  return aux == Aux::kRelu ? 1 : ElementBytes(AuxDType(y));
}
inline const char* AuxName(Aux aux) { return aux == Aux::kRelu ? "relu_aux" : "gelu_aux"; }

// The axis a bias gradient (batch, M or N) runs along, in our row-major naming.
enum class BiasGrad : uint8_t { kNone, kN, kM };

struct EpilogInfo {
  int32_t value;  // the public Epilog value (cuBLASLt's, seen from the row-major API)
  const char* name;
  cublasLtEpilogue_t cublaslt;
  bool bias_in;  // bias (batch_bias, N), AuxDType(y)
  Aux aux_in;
  Aux aux_out;
  BiasGrad bias_grad;  // output (batch, M or N), AuxDType(y)

  Aux aux() const { return aux_in != Aux::kNone ? aux_in : aux_out; }
  // The bias gradient's length per batch; 0 when the epilog has none.
  int64_t BiasGradLength(int64_t m, int64_t n) const {
    return bias_grad == BiasGrad::kM ? m : bias_grad == BiasGrad::kN ? n : 0;
  }
};

// cuBLASLt's A is our b (row-major Y = A B is column-major Y^T = B^T A^T), so our
// BGRADB, b summed over K, is cuBLASLt's BGRADA and vice versa.
inline constexpr EpilogInfo kEpilogs[] = {
    // value, name, cuBLASLt epilogue, bias in, aux in, aux out, bias gradient
    {1, "DEFAULT", CUBLASLT_EPILOGUE_DEFAULT, false, Aux::kNone, Aux::kNone, BiasGrad::kNone},
    {2, "RELU", CUBLASLT_EPILOGUE_RELU, false, Aux::kNone, Aux::kNone, BiasGrad::kNone},
    {130, "RELU_AUX", CUBLASLT_EPILOGUE_RELU_AUX, false, Aux::kNone, Aux::kRelu,
     BiasGrad::kNone},
    {4, "BIAS", CUBLASLT_EPILOGUE_BIAS, true, Aux::kNone, Aux::kNone, BiasGrad::kNone},
    {6, "RELU_BIAS", CUBLASLT_EPILOGUE_RELU_BIAS, true, Aux::kNone, Aux::kNone,
     BiasGrad::kNone},
    {134, "RELU_AUX_BIAS", CUBLASLT_EPILOGUE_RELU_AUX_BIAS, true, Aux::kNone, Aux::kRelu,
     BiasGrad::kNone},
    {136, "DRELU", CUBLASLT_EPILOGUE_DRELU, false, Aux::kRelu, Aux::kNone, BiasGrad::kNone},
    {152, "DRELU_BGRAD", CUBLASLT_EPILOGUE_DRELU_BGRAD, false, Aux::kRelu, Aux::kNone,
     BiasGrad::kN},
    {32, "GELU", CUBLASLT_EPILOGUE_GELU, false, Aux::kNone, Aux::kNone, BiasGrad::kNone},
    {160, "GELU_AUX", CUBLASLT_EPILOGUE_GELU_AUX, false, Aux::kNone, Aux::kGelu,
     BiasGrad::kNone},
    {36, "GELU_BIAS", CUBLASLT_EPILOGUE_GELU_BIAS, true, Aux::kNone, Aux::kNone,
     BiasGrad::kNone},
    {164, "GELU_AUX_BIAS", CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, Aux::kNone, Aux::kGelu,
     BiasGrad::kNone},
    {192, "DGELU", CUBLASLT_EPILOGUE_DGELU, false, Aux::kGelu, Aux::kNone, BiasGrad::kNone},
    {208, "DGELU_BGRAD", CUBLASLT_EPILOGUE_DGELU_BGRAD, false, Aux::kGelu, Aux::kNone,
     BiasGrad::kN},
    {256, "BGRADA", CUBLASLT_EPILOGUE_BGRADB, false, Aux::kNone, Aux::kNone, BiasGrad::kM},
    {512, "BGRADB", CUBLASLT_EPILOGUE_BGRADA, false, Aux::kNone, Aux::kNone, BiasGrad::kN},
};

inline constexpr int32_t kDefaultEpilog = kEpilogs[0].value;

// The row of `value`, or nullptr for a value that is not a public epilog.
inline const EpilogInfo* FindEpilog(int32_t value) {
  for (const EpilogInfo& info : kEpilogs)
    if (info.value == value) return &info;
  return nullptr;
}

inline const char* EpilogName(int32_t value) {
  const EpilogInfo* info = FindEpilog(value);
  return info ? info->name : "UNKNOWN";
}

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_EPILOGS_H_
