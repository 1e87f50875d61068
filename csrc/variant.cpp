// One ISA variant's Kernels table: kernels_<isa>, which dispatch.cpp chooses among.
#include "variant.h"

#define MLXD_CAT_(a, b) a##b
#define MLXD_CAT(a, b) MLXD_CAT_(a, b)
#define MLXD_STR_(a) #a
#define MLXD_STR(a) MLXD_STR_(a)

namespace mlxd {

extern const Kernels MLXD_CAT(kernels_, MLXD_ISA);
const Kernels MLXD_CAT(kernels_, MLXD_ISA) = {
    MLXD_STR(MLXD_ISA),
    &MLXD_ISA::qmatmul_f32,
    &MLXD_ISA::qmatmul_f16,
    &MLXD_ISA::qdot_f32,
    &MLXD_ISA::qdot_f16,
    MLXD_ISA::integer_dot,
    &MLXD_ISA::attention,
    &MLXD_ISA::rms_norm,
    &MLXD_ISA::swiglu,
    &MLXD_ISA::gather_qmatmul_f32,
    &MLXD_ISA::gather_qmatmul_f16,
    &MLXD_ISA::gather_qdot_f32,
    &MLXD_ISA::gather_qdot_f16,
    &MLXD_ISA::sample,
};

}  // namespace mlxd
