# Sourced by scripts/test.sh and scripts/test_repeat.sh: how the test suite runs.
#
# MPI start-up: Open MPI's cm PML opens its PSM and PSM2 MTLs at every MPI_Init, and their
# libraries look for Omni-Path / True Scale hardware for about 0.2 s, though ob1 is what runs on
# a machine without such a fabric. The suite starts a few hundred MPI processes, so it leaves cm
# out (Debian's /etc/openmpi/openmpi-mca-params.conf already leaves out ucx). A setting of the
# caller's own wins.
export OMPI_MCA_pml=${OMPI_MCA_pml:-^ucx,cm}
# hwloc's topology discovery (in mpirun and in each MPI process) reads every PCI device's
# configuration space and the PCI name table, and its GL plugin tries X displays: none of it
# matters to single-node CPU tests, and PCI reads trap to the hypervisor in a virtual machine.
# Leaving those parts out took an 8-rank MPI start from 0.95 to 0.78 s of CPU (2 cores).
export HWLOC_COMPONENTS=${HWLOC_COMPONENTS:--pci,-linuxio,-gl,-opencl}
# ctest -j: two slots more than there are cores. An MPI test takes two slots; the tests that
# mostly wait (PROCESSORS 1: Slurm, signals, process start-ups) run beside the busy ones, which
# kept 2 cores about 80% busy at nproc + 2 (66% at nproc + 1).
KMOE_CTEST_JOBS=${KMOE_CTEST_JOBS:-$(( $(nproc) + 2 ))}
