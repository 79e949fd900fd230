// Thin RAII layer over the HDF5 C API for kmoe's parallel files: one shared file opened
// collectively with MPI-IO, datasets at global shapes, attributes, and every call checked so a
// failure names the file and the object instead of printing an HDF5 error stack.
#pragma once

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kmoe {

// Owns one hid_t and closes it with the matching H5*close.
class H5Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Handle() = default;
  H5Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  ~H5Handle() { reset(); }
  H5Handle(H5Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  H5Handle& operator=(H5Handle&& o) noexcept;
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;
  hid_t get() const { return id_; }
  void reset();
  void release() { id_ = -1; }  // forget the id without closing it (closed elsewhere)

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

// True once a file was abandoned: HDF5 must not touch it at MPI_Finalize (its close could
// fail or wait forever), so the driver ends the process with MPI_Abort instead.
bool hdf5_files_abandoned();

class H5File {
 public:
  // Collective over `comm`. create: truncates; open: read-only. Errors name `path`.
  static H5File create(const std::string& path, MPI_Comm comm);
  static H5File open(const std::string& path, MPI_Comm comm);

  const std::string& path() const { return path_; }
  // Called after every block of rows a write or read moves (a long transfer is progress).
  void set_progress(std::function<void()> f) { progress_ = std::move(f); }
  // Test-only: the next dataset write is created, then fails as on a full disk (KMOE_FAULT).
  void fail_next_write() { fail_next_write_ = true; }
  hid_t id() const { return file_.get(); }
  void close() { file_.reset(); }  // collective
  // Collective. False when HDF5 could not close the file (its final flush failed, e.g. on a
  // full disk): the file is still open and may be closed again once there is room.
  bool try_close();
  // Forgets the file without closing it: after a failed collective write the ranks' views of
  // the file can disagree, and a collective close could then wait forever. The job ends (MPI
  // abort) without HDF5 touching the file again.
  void abandon();

  bool exists(const std::string& object) const;  // a group or dataset path like "/model/x"
  // Shape of a dataset; throws naming the file and dataset when it is missing.
  std::vector<std::int64_t> shape(const std::string& dataset) const;

  // Collective: every rank calls with the same path and shape; only ranks with write == true
  // transfer data (the whole dataset, from `data`, row-major). Intermediate groups are created.
  void write_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                 const float* data, bool write);
  void write_i32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                 const std::int32_t* data, bool write);
  // The same for a row block: ranks with write == true store rows [row_begin, row_begin + rows)
  // of dimension 0 (their hyperslab) from `data`.
  void write_rows_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                      std::int64_t row_begin, std::int64_t rows, const float* data, bool write);
  // Reads the whole dataset (checking its shape equals `shape`) into `data`.
  void read_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                float* data) const;
  // Reads rows [row_begin, row_begin + rows) of dimension 0 (the dataset's shape must equal
  // `shape`) into `data`. Independent: only this rank's hyperslab is read.
  void read_rows_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                     std::int64_t row_begin, std::int64_t rows, float* data) const;

  // Attributes on an object ("/" or a group, created if missing). Collective for writes.
  void set_attr(const std::string& object, const std::string& name, const std::string& value);
  void set_attr(const std::string& object, const std::string& name, std::int64_t value);
  void set_attr(const std::string& object, const std::string& name, double value);
  void set_attr(const std::string& object, const std::string& name,
                const std::vector<std::int64_t>& values);
  bool has_attr(const std::string& object, const std::string& name) const;
  std::string attr_string(const std::string& object, const std::string& name) const;
  std::int64_t attr_int(const std::string& object, const std::string& name) const;
  double attr_double(const std::string& object, const std::string& name) const;

 private:
  H5File(std::string path, H5Handle file) : path_(std::move(path)), file_(std::move(file)) {}
  void write_raw(const std::string& dataset, const std::vector<std::int64_t>& shape, hid_t type,
                 const void* data, std::size_t elem_bytes, bool write, std::int64_t row_begin,
                 std::int64_t rows);
  H5Handle open_or_create_group(const std::string& object);

  std::string path_;
  H5Handle file_;
  std::function<void()> progress_;
  bool fail_next_write_ = false;
};

}  // namespace kmoe
