# Provides: RAF_DIST_CUDA_ENABLED and target CUDA::cudart when USE_CUDA resolves to ON.
# AUTO turns CUDA on only when a toolkit is found.
set(RAF_DIST_CUDA_ENABLED OFF)
if(USE_CUDA)  # ON or AUTO
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(RAF_DIST_CUDA_ENABLED ON)
    message(STATUS "raf_dist: CUDA ${CUDAToolkit_VERSION} at ${CUDAToolkit_LIBRARY_DIR}")
  elseif(USE_CUDA STREQUAL "AUTO")
    message(STATUS "raf_dist: CUDA toolkit not found; building without CUDA (USE_CUDA=AUTO)")
  else()
    message(FATAL_ERROR "raf_dist: USE_CUDA=ON but no CUDA toolkit was found; install one or "
                        "set USE_CUDA to AUTO/OFF in config.cmake")
  endif()
endif()
