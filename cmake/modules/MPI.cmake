# Provides: target raf_dist::mpi (MPI C headers and libmpi), or stops the build.
# Looks first at the Python environment (the mpich wheel puts mpi.h in <prefix>/include and
# libmpi in <prefix>/lib), then at the system. Links libmpi, never libmpi_abi: the two define
# MPI_Comm differently and mpi4py hands us a libmpi communicator.
if(NOT USE_MPI)
  message(FATAL_ERROR "USE_MPI=OFF is not supported: raf_dist's launcher contract is MPI "
                      "(mpirun/mpiexec). Set USE_MPI ON in config.cmake.")
endif()

find_path(RAF_DIST_MPI_INCLUDE mpi.h HINTS "${RAF_DIST_PYTHON_PREFIX}/include" NO_DEFAULT_PATH)
find_library(RAF_DIST_MPI_LIBRARY NAMES mpi HINTS "${RAF_DIST_PYTHON_PREFIX}/lib" NO_DEFAULT_PATH)
if(RAF_DIST_MPI_INCLUDE AND RAF_DIST_MPI_LIBRARY)
  add_library(raf_dist::mpi INTERFACE IMPORTED)
  target_include_directories(raf_dist::mpi INTERFACE "${RAF_DIST_MPI_INCLUDE}")
  target_link_libraries(raf_dist::mpi INTERFACE "${RAF_DIST_MPI_LIBRARY}")
  message(STATUS "raf_dist: MPI from the Python environment: ${RAF_DIST_MPI_LIBRARY}")
else()
  find_package(MPI COMPONENTS C)
  if(NOT MPI_C_FOUND)
    message(FATAL_ERROR "raf_dist: no MPI found. Install one: `pip install mpich` (or your "
                        "system's MPI development package), then rebuild.")
  endif()
  add_library(raf_dist::mpi INTERFACE IMPORTED)
  target_link_libraries(raf_dist::mpi INTERFACE MPI::MPI_C)
  message(STATUS "raf_dist: MPI from the system: ${MPI_C_LIBRARIES}")
endif()
# The runtime uses MPI's C API only. Compiled as C++, Open MPI's (and old MPICH's) mpi.h pulls
# in the deprecated C++ bindings, whose symbols (MPI::Datatype::Free, ...) live in libmpi_cxx,
# which we do not link: loading libraf_dist.so then failed on a GPU host with Open MPI 4.1.
target_compile_definitions(raf_dist::mpi INTERFACE OMPI_SKIP_MPICXX MPICH_SKIP_MPICXX)
