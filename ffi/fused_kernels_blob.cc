// The fused kernels' fatbin (nvcc's output for fused_kernels.cu), as the bytes of the
// hidden symbol jax_epilog_fused_fatbin, which fused_passes.cc hands to cudaLibraryLoadData.
// Compiled only where CMakeLists.txt found nvcc; JAX_EPILOG_FUSED_FATBIN is the fatbin's path.
#ifndef JAX_EPILOG_FUSED_FATBIN
#error "JAX_EPILOG_FUSED_FATBIN (the fatbin's path) is set by CMakeLists.txt"
#endif

__asm__(
    ".pushsection .rodata.jax_epilog_fused_fatbin, \"a\", @progbits\n"
    ".balign 64\n"
    ".globl jax_epilog_fused_fatbin\n"
    ".hidden jax_epilog_fused_fatbin\n"
    ".type jax_epilog_fused_fatbin, @object\n"
    "jax_epilog_fused_fatbin:\n"
    ".incbin \"" JAX_EPILOG_FUSED_FATBIN "\"\n"
    ".size jax_epilog_fused_fatbin, . - jax_epilog_fused_fatbin\n"
    ".popsection\n");
