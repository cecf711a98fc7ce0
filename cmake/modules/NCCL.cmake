# Provides: RAF_DIST_NCCL_ENABLED and target raf_dist::nccl when USE_NCCL resolves to ON.
# Searches the Python environment's nvidia-nccl wheels (site-packages/nvidia/nccl{,_cu13})
# first, then NCCL_ROOT and the system. NCCL without CUDA is impossible: USE_NCCL=ON with CUDA
# off stops the configure step.
set(RAF_DIST_NCCL_ENABLED OFF)
if(USE_NCCL)
  if(NOT RAF_DIST_CUDA_ENABLED)
    if(USE_NCCL STREQUAL "AUTO")
      message(STATUS "raf_dist: NCCL off because CUDA is off (USE_NCCL=AUTO)")
      return()
    endif()
    message(FATAL_ERROR "raf_dist: USE_NCCL=ON requires CUDA, but CUDA is off or was not "
                        "found. Set USE_CUDA ON with a CUDA toolkit, or USE_NCCL OFF.")
  endif()
  file(GLOB _nccl_wheel_dirs "${RAF_DIST_PYTHON_PURELIB}/nvidia/nccl*")
  find_path(RAF_DIST_NCCL_INCLUDE nccl.h
            HINTS ${_nccl_wheel_dirs} $ENV{NCCL_ROOT} ${NCCL_ROOT}
            PATH_SUFFIXES include)
  find_library(RAF_DIST_NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ${_nccl_wheel_dirs} $ENV{NCCL_ROOT} ${NCCL_ROOT}
               PATH_SUFFIXES lib lib64)
  if(RAF_DIST_NCCL_INCLUDE AND RAF_DIST_NCCL_LIBRARY)
    set(RAF_DIST_NCCL_ENABLED ON)
    add_library(raf_dist::nccl INTERFACE IMPORTED)
    target_include_directories(raf_dist::nccl INTERFACE "${RAF_DIST_NCCL_INCLUDE}")
    target_link_libraries(raf_dist::nccl INTERFACE "${RAF_DIST_NCCL_LIBRARY}")
    message(STATUS "raf_dist: NCCL at ${RAF_DIST_NCCL_LIBRARY}")
  elseif(USE_NCCL STREQUAL "AUTO")
    message(STATUS "raf_dist: NCCL not found; building without NCCL (USE_NCCL=AUTO; "
                   "pip install nvidia-nccl-cu12 to enable)")
  else()
    message(FATAL_ERROR "raf_dist: USE_NCCL=ON but nccl.h / libnccl were not found; "
                        "pip install nvidia-nccl-cu12 (or cu13) or set NCCL_ROOT")
  endif()
endif()
