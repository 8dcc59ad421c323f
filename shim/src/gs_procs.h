/*
 * Which driver entry point serves cuGetProcAddress(name, cudaVersion, flags): one list, read by the
 * driver test double (its cuGetProcAddress table) and by the shim (to find its wrapper by name when
 * a driver hands out a pointer that is not its exported symbol). From cuda.h's versioned #defines:
 * `since` is the first CUDA version (1000 * major + 10 * minor) a variant serves.
 *
 *   X(base, since, fn)            fn serves base from `since` (each fn once in _UNIQUE)
 *   XP(base, since, fn, ptsz)     ... and ptsz with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 */
#ifndef GS_PROCS_H
#define GS_PROCS_H

#define GS_DRIVER_PROCS_UNIQUE(X, XP) \
    X(cuInit, 2000, cuInit) \
    X(cuDriverGetVersion, 2020, cuDriverGetVersion) \
    X(cuDeviceGet, 2000, cuDeviceGet) \
    X(cuDeviceGetCount, 2000, cuDeviceGetCount) \
    X(cuDeviceGetName, 2000, cuDeviceGetName) \
    X(cuDeviceGetUuid, 9020, cuDeviceGetUuid) \
    X(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2) \
    X(cuDeviceTotalMem, 2000, cuDeviceTotalMem) \
    X(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2) \
    X(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute) \
    X(cuDeviceGetPCIBusId, 4010, cuDeviceGetPCIBusId) \
    X(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain) \
    X(cuDevicePrimaryCtxRelease, 7000, cuDevicePrimaryCtxRelease) \
    X(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2) \
    X(cuDevicePrimaryCtxReset, 7000, cuDevicePrimaryCtxReset) \
    X(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState) \
    X(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2) \
    X(cuCtxCreate, 2000, cuCtxCreate) \
    X(cuCtxCreate, 3020, cuCtxCreate_v2) \
    X(cuCtxCreate, 11040, cuCtxCreate_v3) \
    X(cuCtxCreate, 12050, cuCtxCreate_v4) \
    X(cuCtxDestroy, 4000, cuCtxDestroy_v2) \
    X(cuCtxSetCurrent, 4000, cuCtxSetCurrent) \
    X(cuCtxGetCurrent, 4000, cuCtxGetCurrent) \
    X(cuCtxGetDevice, 2000, cuCtxGetDevice) \
    X(cuCtxSynchronize, 2000, cuCtxSynchronize) \
    X(cuMemGetInfo, 2000, cuMemGetInfo) \
    X(cuMemGetInfo, 3020, cuMemGetInfo_v2) \
    X(cuMemAlloc, 2000, cuMemAlloc) \
    X(cuMemAlloc, 3020, cuMemAlloc_v2) \
    X(cuMemAllocPitch, 2000, cuMemAllocPitch) \
    X(cuMemAllocPitch, 3020, cuMemAllocPitch_v2) \
    X(cuMemAllocManaged, 6000, cuMemAllocManaged) \
    X(cuMemFree, 2000, cuMemFree) \
    X(cuMemFree, 3020, cuMemFree_v2) \
    X(cuMemGetAddressRange, 3020, cuMemGetAddressRange_v2) \
    XP(cuMemAllocAsync, 11020, cuMemAllocAsync, cuMemAllocAsync_ptsz) \
    XP(cuMemFreeAsync, 11020, cuMemFreeAsync, cuMemFreeAsync_ptsz) \
    X(cuMemPoolCreate, 11020, cuMemPoolCreate) \
    X(cuMemPoolDestroy, 11020, cuMemPoolDestroy) \
    XP(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz) \
    X(cuMemCreate, 10020, cuMemCreate) \
    X(cuMemRelease, 10020, cuMemRelease) \
    X(cuMemAddressReserve, 10020, cuMemAddressReserve) \
    X(cuMemAddressFree, 10020, cuMemAddressFree) \
    X(cuMemMap, 10020, cuMemMap) \
    X(cuMemUnmap, 10020, cuMemUnmap) \
    X(cuMemSetAccess, 10020, cuMemSetAccess) \
    X(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle) \
    X(cuMemExportToShareableHandle, 10020, cuMemExportToShareableHandle) \
    X(cuMemImportFromShareableHandle, 10020, cuMemImportFromShareableHandle) \
    X(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity) \
    X(cuArrayCreate, 2000, cuArrayCreate) \
    X(cuArrayCreate, 3020, cuArrayCreate_v2) \
    X(cuArray3DCreate, 2000, cuArray3DCreate) \
    X(cuArray3DCreate, 3020, cuArray3DCreate_v2) \
    X(cuArrayDestroy, 2000, cuArrayDestroy) \
    X(cuMipmappedArrayCreate, 5000, cuMipmappedArrayCreate) \
    X(cuMipmappedArrayDestroy, 5000, cuMipmappedArrayDestroy) \
    X(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle) \
    X(cuIpcOpenMemHandle, 4010, cuIpcOpenMemHandle) \
    X(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle_v2) \
    X(cuIpcCloseMemHandle, 4010, cuIpcCloseMemHandle) \
    X(cuModuleLoadData, 2000, cuModuleLoadData) \
    X(cuModuleGetFunction, 2000, cuModuleGetFunction) \
    XP(cuLaunchKernel, 4000, cuLaunchKernel, cuLaunchKernel_ptsz) \
    XP(cuLaunchKernelEx, 11060, cuLaunchKernelEx, cuLaunchKernelEx_ptsz) \
    XP(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz) \
    XP(cuGraphLaunch, 10000, cuGraphLaunch, cuGraphLaunch_ptsz) \
    X(cuStreamCreate, 2000, cuStreamCreate) \
    X(cuCtxSetLimit, 3010, cuCtxSetLimit) \
    X(cuCtxGetLimit, 3010, cuCtxGetLimit) \
    X(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool) \
    X(cuDeviceGetMemPool, 11020, cuDeviceGetMemPool) \
    X(cuMemPoolTrimTo, 11020, cuMemPoolTrimTo) \
    X(cuMemPoolSetAttribute, 11020, cuMemPoolSetAttribute) \
    X(cuMemPoolGetAttribute, 11020, cuMemPoolGetAttribute) \
    X(cuGraphAddMemAllocNode, 11040, cuGraphAddMemAllocNode) \
    X(cuGraphAddMemFreeNode, 11040, cuGraphAddMemFreeNode) \
    X(cuDeviceGraphMemTrim, 11040, cuDeviceGraphMemTrim) \
    X(cuDeviceGetGraphMemAttribute, 11040, cuDeviceGetGraphMemAttribute) \
    X(cuGraphCreate, 10000, cuGraphCreate) \
    X(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags) \
    X(cuGraphExecDestroy, 10000, cuGraphExecDestroy) \
    X(cuGraphDestroy, 10000, cuGraphDestroy) \
    X(cuImportExternalMemory, 10000, cuImportExternalMemory) \
    X(cuDestroyExternalMemory, 10000, cuDestroyExternalMemory) \
    X(cuEventCreate, 2000, cuEventCreate) \
    X(cuEventRecord, 2000, cuEventRecord) \
    X(cuEventSynchronize, 2000, cuEventSynchronize) \
    X(cuEventElapsedTime, 2000, cuEventElapsedTime) \
    X(cuEventDestroy, 4000, cuEventDestroy_v2) \
    X(cuStreamSynchronize, 2000, cuStreamSynchronize) \
    X(cuGetErrorName, 6000, cuGetErrorName) \
    X(cuGetErrorString, 6000, cuGetErrorString) \
    X(cuGetProcAddress, 11030, cuGetProcAddress) \
    X(cuGetProcAddress, 12000, cuGetProcAddress_v2)

/* Entries whose function also serves another name (each function appears once above). */
#define GS_DRIVER_PROCS_ALIASES(X, XP) X(cuGraphInstantiate, 11000, cuGraphInstantiateWithFlags)

#define GS_DRIVER_PROCS(X, XP) GS_DRIVER_PROCS_UNIQUE(X, XP) GS_DRIVER_PROCS_ALIASES(X, XP)

#endif
