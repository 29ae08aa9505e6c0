#if defined(_MSC_VER) && !defined(__clang__) && _MSC_VER < 1940
#define _tl_orig_alignas alignas
#define alignas(N) _tl_orig_alignas((N) <= 64 ? (N) : 64)
#include <cuda.h>
#undef alignas
#define alignas _tl_orig_alignas
#endif
#include <tl_templates/cuda/instruction/wgmma.h>
#include <tl_templates/cuda/intrin.h>
#include <tl_templates/cuda/barrier.h>
#include <tl_templates/cuda/copy_sm90.h>
#include <tl_templates/cuda/reduce.h>
#include <tl_templates/cuda/scan.h>
#include <tl_templates/cuda/ldsm.h>
#include <tl_templates/cuda/threadblock_swizzle.h>
#include <tl_templates/cuda/debug.h>
#ifdef ENABLE_BF16
#include <tl_templates/cuda/cuda_bf16_fallbacks.cuh>
#endif

extern "C" __global__ void main_kernel(__grid_constant__ const CUtensorMap A_desc, __grid_constant__ const CUtensorMap B_desc, __grid_constant__ const CUtensorMap C_desc);
extern "C" __global__ void __launch_bounds__(384, 1) main_kernel(__grid_constant__ const CUtensorMap A_desc, __grid_constant__ const CUtensorMap B_desc, __grid_constant__ const CUtensorMap C_desc) {
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  void* a_s = ((void*)((char*)buf_dyn_shmem + 0));
  void* c_s = ((void*)((char*)buf_dyn_shmem + 0));
  void* b_s = ((void*)((char*)buf_dyn_shmem + 196608));
  __shared__ __align__(16) uint64_t mbarrier_mem[12];
  auto mbarrier = reinterpret_cast<Barrier*>(mbarrier_mem);
  float c_l[64];
  if (tl::tl_shuffle_elect<0>()) {
    tl::prefetch_tma_descriptor(A_desc);
    tl::prefetch_tma_descriptor(B_desc);
    tl::prefetch_tma_descriptor(C_desc);
  }
  if (tl::tl_shuffle_elect<0>()) {
    mbarrier[0].init(1);
    mbarrier[1].init(1);
    mbarrier[2].init(1);
    mbarrier[3].init(1);
    mbarrier[4].init(1);
    mbarrier[5].init(1);
    mbarrier[6].init(256);
    mbarrier[7].init(256);
    mbarrier[8].init(256);
    mbarrier[9].init(256);
    mbarrier[10].init(256);
    mbarrier[11].init(256);
  }
  tl::fence_barrier_init();
  __syncthreads();
  const dim3 blockIdx = tl::rasterization2DRow<10>();
  if (((int)threadIdx.x) < 128) {
    tl::warpgroup_reg_dealloc<24>();
    mbarrier[6].wait(1);
    if (tl::tl_shuffle_elect<128>()) {
      mbarrier[0].expect_transaction(32768);
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        tl::tma_load(A_desc, mbarrier[0], (&(((bfloat16_t*)a_s)[(i * 8192)])), (i * 64), 0);
      }
      mbarrier[0].arrive_and_expect_tx(32768);
      #pragma unroll
      for (int i_1 = 0; i_1 < 2; ++i_1) {
        tl::tma_load(B_desc, mbarrier[0], (&(((bfloat16_t*)b_s)[(i_1 * 8192)])), (i_1 * 64), 0);
      }
    }
  } else {
    tl::warpgroup_reg_alloc<240>();
    #pragma unroll
    for (int i_2 = 0; i_2 < 16; ++i_2) {
      float broadcast_var = 0x0p+0f/*0.000000e+00*/;
      *(float4*)(c_l + (i_2 * 4)) = make_float4(broadcast_var, broadcast_var, broadcast_var, broadcast_var);
    }
    mbarrier[0].wait(0);
    {
      tl::GmmaDescriptor desc_a;
      tl::GmmaDescriptor desc_b;
      tl::initialize_wgmma_descriptor<1, 1, 64>(desc_a, (&(((bfloat16_t*)a_s)[0])));
      tl::initialize_wgmma_descriptor<1, 1, 64>(desc_b, (&(((bfloat16_t*)b_s)[0])));
      tl::warpgroup_fence_operand(reinterpret_cast<float*>(c_l + 0), 64);
      tl::warpgroup_arrive();
      #pragma unroll
      for (int i_3 = 0; i_3 < 2; ++i_3) {
        #pragma unroll
        for (int ki = 0; ki < 8; ++ki) {
          tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 64, 16, false, false, 1, 1>(uint64_t(desc_a + (((((ki >> 2) * 16384) + (i_3 * 8192)) + ((ki & 3) * 32)) >> 4)), uint64_t(desc_b + (((((ki >> 2) * 16384) + ((((((int)threadIdx.x) >> 7) + 1) & 1) * 8192)) + ((ki & 3) * 32)) >> 4)), ((uint32_t*)(c_l + (i_3 * 32))), 1);
        }
      }
      tl::warpgroup_commit_batch();
      tl::warpgroup_wait<0>();
      tl::warpgroup_fence_operand(reinterpret_cast<float*>(c_l + 0), 64);
    }
    mbarrier[6].arrive();
    tl::__sync_thread_partial(3, 256);
    #pragma unroll
    for (int i_4 = 0; i_4 < 8; ++i_4) {
      tl::ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)c_s)[(((((((((((int)threadIdx.x) >> 7) * 8192) + ((i_4 >> 2) * 4096)) + (((((int)threadIdx.x) & 127) >> 5) * 1024)) + ((((int)threadIdx.x) & 15) * 64)) + (((((((int)threadIdx.x) & 7) >> 2) + ((i_4 & 3) >> 1)) & 1) * 32)) + (((((((int)threadIdx.x) & 3) >> 1) + (i_4 & 1)) & 1) * 16)) + (((((((int)threadIdx.x) & 31) >> 4) + (((int)threadIdx.x) & 1)) & 1) * 8)) - 8192)])), __pack_half2(((bfloat16_t)c_l[(i_4 * 8)]), ((bfloat16_t)c_l[((i_4 * 8) + 1)])), __pack_half2(((bfloat16_t)c_l[((i_4 * 8) + 2)]), ((bfloat16_t)c_l[((i_4 * 8) + 3)])), __pack_half2(((bfloat16_t)c_l[((i_4 * 8) + 4)]), ((bfloat16_t)c_l[((i_4 * 8) + 5)])), __pack_half2(((bfloat16_t)c_l[((i_4 * 8) + 6)]), ((bfloat16_t)c_l[((i_4 * 8) + 7)])));
    }
    tl::__sync_thread_partial(3, 256);
    if (tl::tl_shuffle_elect<256>()) {
      tl::fence_proxy_async();
      #pragma unroll
      for (int i_5 = 0; i_5 < 2; ++i_5) {
        tl::tma_store(C_desc, (&(((bfloat16_t*)c_s)[(i_5 * 8192)])), (i_5 * 64), 0);
      }
      tl::tma_store_arrive();
      tl::tma_store_wait<0, true>();
    }
  }
}

