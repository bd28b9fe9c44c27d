// cuda_emu's stand-in for NCCL: communicators of one process whose collectives are a
// rendezvous of the ranks' streams (a rank's stream, when run, also runs its peers'
// streams up to the same collective). Non-blocking communicators (config.blocking = 0)
// answer ncclInProgress until polled with ncclCommGetAsyncError; group calls defer to
// ncclGroupEnd; ncclCommAbort ends the rank's pending collectives and frees the handle,
// so a later or concurrent use of it is reported. Faults are injectable (cuda_emu/emu.h,
// or TPSIM_EMU_NCCL_FAULT).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#define NCCL_MAJOR 2
#define NCCL_MINOR 21
#define NCCL_PATCH 0
#define NCCL_VERSION_CODE 22100
#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_CONFIG_UNDEF_INT (-2147483648)

enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
enum ncclDataType_t {
  ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2, ncclUint32 = 3,
  ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6, ncclFloat32 = 7, ncclFloat = 7,
  ncclFloat64 = 8, ncclDouble = 8, ncclBfloat16 = 9,
};
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };

struct ncclUniqueId {
  char internal[NCCL_UNIQUE_ID_BYTES];
};
struct ncclComm;
typedef ncclComm* ncclComm_t;

struct ncclConfig_t {
  std::size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
};
#define NCCL_CONFIG_INITIALIZER                                                    \
  {sizeof(ncclConfig_t), 0xcafebeefu, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT,   \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, nullptr,  \
   NCCL_CONFIG_UNDEF_INT}

const char* ncclGetErrorString(ncclResult_t r);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetVersion(int* version);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();

ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t dt,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t send_count,
                           ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t recv_count,
                               ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t dt,
                           int root, ncclComm_t comm, cudaStream_t stream);
// Point to point. Inside ncclGroupStart/End a rank's sends and receives on one communicator
// are one operation (NCCL fuses them into one launch); the emulator rendezvous them as one
// collective, so every rank of the communicator must issue its group at the same point (as
// an all-to-all does), and each send must meet the peer's receive of the same count.
ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t dt, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t dt, int peer,
                      ncclComm_t comm, cudaStream_t stream);
