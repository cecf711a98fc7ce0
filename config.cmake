# raf_dist build configuration. setup.py passes this file to CMake; edit it (or set the
# same names with -D / environment variables of the same name) to change the build.
#
# USE_MPI   ON   host-tensor collectives over MPI (required: the launcher contract is MPI).
# USE_CUDA  AUTO ON when a CUDA toolkit is found; OFF with a one-line notice otherwise.
# USE_NCCL  AUTO ON when CUDA is on and NCCL headers/libraries are found (for example from
#                the nvidia-nccl-cu12 / nvidia-nccl-cu13 wheels); OFF with a notice otherwise.
# Values: ON, OFF, AUTO. ON fails the configure step if the dependency is missing.
set(USE_MPI ON)
set(USE_CUDA AUTO)
set(USE_NCCL AUTO)
