#include "io/hdf5_file.hpp"

#include <algorithm>
#include <filesystem>

#include "core/device_memory.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {
const char* const kHdf5NeedsHost =
    "HDF5 reads and writes host memory: give it a host copy (core/device_sync.hpp host_copy)";
}  // namespace

H5Handle& H5Handle::operator=(H5Handle&& o) noexcept {
  if (this != &o) {
    reset();
    id_ = o.id_;
    close_ = o.close_;
    o.id_ = -1;
  }
  return *this;
}

void H5Handle::reset() {
  if (id_ >= 0 && close_) close_(id_);
  id_ = -1;
}

namespace {

// HDF5 prints an error stack on every failed call by default; kmoe reports errors itself.
void silence_hdf5() {
  static bool done = false;
  if (!done) H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  done = true;
}

H5Handle file_access(MPI_Comm comm, bool writing) {
  H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL);
  // Collective metadata writes (every rank creates every dataset) are only safe from HDF5
  // 1.10.9 on. Metadata reads stay independent: on resume each rank opens only the datasets of
  // its own stage.
#if H5_VERSION_GE(1, 10, 9)
  if (writing) H5Pset_coll_metadata_write(fapl.get(), true);
#else
  (void)writing;
#endif
  return fapl;
}

std::vector<hsize_t> dims_of(const std::vector<std::int64_t>& shape) {
  return std::vector<hsize_t>(shape.begin(), shape.end());
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string t = "[";
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

H5Handle string_type() {
  H5Handle t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t.get(), H5T_VARIABLE);
  H5Tset_cset(t.get(), H5T_CSET_UTF8);
  return t;
}

// No single MPI-IO transfer may exceed 2^31-1 bytes per rank: write in row blocks of <= 1 GiB.
constexpr std::int64_t kMaxTransferBytes = std::int64_t(1) << 30;

}  // namespace

H5File H5File::create(const std::string& path, MPI_Comm comm) {
  silence_hdf5();
  H5Handle fapl = file_access(comm, true);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  KMOE_REQUIRE(f >= 0, path << ": cannot create HDF5 file (directory missing or not writable?)");
  return H5File(path, H5Handle(f, H5Fclose));
}

H5File H5File::open(const std::string& path, MPI_Comm comm) {
  silence_hdf5();
  KMOE_REQUIRE(std::filesystem::exists(path), path << ": no such file");
#if H5_VERSION_GE(1, 12, 0)
  const htri_t is_hdf5 = H5Fis_accessible(path.c_str(), H5P_DEFAULT);
#else
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
#endif
  KMOE_REQUIRE(is_hdf5 > 0, path << ": not an HDF5 file (another format, or damaged)");
  H5Handle fapl = file_access(comm, false);
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get());
  KMOE_REQUIRE(f >= 0, path << ": cannot open as HDF5 (truncated or damaged file)");
  return H5File(path, H5Handle(f, H5Fclose));
}

namespace {
bool g_abandoned = false;
}  // namespace

bool hdf5_files_abandoned() { return g_abandoned; }

void H5File::abandon() {
  if (file_.get() >= 0) g_abandoned = true;
  file_.release();
}

bool H5File::try_close() {
  if (file_.get() < 0) return true;
  if (H5Fclose(file_.get()) < 0) return false;
  file_.release();
  return true;
}

bool H5File::exists(const std::string& object) const {
  // Check each prefix: H5Lexists fails on a missing intermediate group.
  std::size_t pos = 0;
  while ((pos = object.find('/', pos + 1)) != std::string::npos) {
    if (H5Lexists(id(), object.substr(0, pos).c_str(), H5P_DEFAULT) <= 0) return false;
  }
  return object == "/" || H5Lexists(id(), object.c_str(), H5P_DEFAULT) > 0;
}

std::vector<std::int64_t> H5File::shape(const std::string& dataset) const {
  KMOE_REQUIRE(exists(dataset), path_ << ": dataset " << dataset << " is missing");
  H5Handle d(H5Dopen2(id(), dataset.c_str(), H5P_DEFAULT), H5Dclose);
  KMOE_REQUIRE(d.get() >= 0, path_ << ": cannot open dataset " << dataset);
  H5Handle s(H5Dget_space(d.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(s.get());
  KMOE_REQUIRE(rank >= 0, path_ << ": dataset " << dataset << " has no simple shape");
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(s.get(), dims.data(), nullptr);
  return std::vector<std::int64_t>(dims.begin(), dims.end());
}

void H5File::write_raw(const std::string& dataset, const std::vector<std::int64_t>& shape,
                       hid_t type, const void* data, std::size_t elem_bytes, bool write,
                       std::int64_t row_begin, std::int64_t rows) {
  if (write && device_memory_check_on()) {
    std::int64_t row_elems = 1;
    for (std::size_t i = 1; i < shape.size(); ++i) row_elems *= shape[i];
    require_host_memory(data, static_cast<std::size_t>(rows * row_elems) * elem_bytes,
                        path_ + ": writing dataset " + dataset, kHdf5NeedsHost);
  }
  H5Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  const auto dims = dims_of(shape);
  H5Handle space(H5Screate_simple(dims.size(), dims.data(), nullptr), H5Sclose);
  // Every element is written by its owner: no fill values (parallel HDF5 allocates datasets
  // early and would otherwise write the whole dataset twice).
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
  H5Handle d(
      H5Dcreate2(id(), dataset.c_str(), type, space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
      H5Dclose);
  KMOE_REQUIRE(d.get() >= 0, path_ << ": cannot create dataset " << dataset);
  if (fail_next_write_) {
    fail_next_write_ = false;
    KMOE_REQUIRE(!write, path_ << ": writing dataset " << dataset
                               << " failed: No space left on device (KMOE_FAULT)");
  }
  if (!write || shape.empty()) return;
  std::int64_t row_elems = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) row_elems *= shape[i];
  KMOE_REQUIRE(row_begin >= 0 && row_begin + rows <= shape[0],
               path_ << ": rows [" << row_begin << ", " << row_begin + rows << ") of dataset "
                     << dataset << " outside its " << shape[0] << " rows");
  const std::int64_t block = std::max<std::int64_t>(
      1, kMaxTransferBytes / std::max<std::int64_t>(1, row_elems * elem_bytes));
  for (std::int64_t r0 = 0; r0 < rows; r0 += block) {
    const std::int64_t nr = std::min(block, rows - r0);
    std::vector<hsize_t> start(dims.size(), 0), count = dims;
    start[0] = row_begin + r0;
    count[0] = nr;
    H5Handle fspace(H5Dget_space(d.get()), H5Sclose);
    H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
    H5Handle mspace(H5Screate_simple(count.size(), count.data(), nullptr), H5Sclose);
    const char* src = static_cast<const char*>(data) + r0 * row_elems * elem_bytes;
    KMOE_REQUIRE(H5Dwrite(d.get(), type, mspace.get(), fspace.get(), H5P_DEFAULT, src) >= 0,
                 path_ << ": writing dataset " << dataset << " failed");
    if (progress_) progress_();
  }
}

void H5File::write_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                       const float* data, bool write) {
  write_raw(dataset, shape, H5T_NATIVE_FLOAT, data, sizeof(float), write, 0,
            shape.empty() ? 1 : shape[0]);
}

void H5File::write_i32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                       const std::int32_t* data, bool write) {
  write_raw(dataset, shape, H5T_NATIVE_INT32, data, sizeof(std::int32_t), write, 0,
            shape.empty() ? 1 : shape[0]);
}

void H5File::write_rows_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                            std::int64_t row_begin, std::int64_t rows, const float* data,
                            bool write) {
  write_raw(dataset, shape, H5T_NATIVE_FLOAT, data, sizeof(float), write, row_begin, rows);
}

void H5File::read_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                      float* data) const {
  read_rows_f32(dataset, shape, 0, shape.empty() ? 1 : shape[0], data);
}

void H5File::read_rows_f32(const std::string& dataset, const std::vector<std::int64_t>& shape,
                           std::int64_t row_begin, std::int64_t rows, float* data) const {
  const auto actual = this->shape(dataset);
  KMOE_REQUIRE(actual == shape, path_ << ": dataset " << dataset << " has shape "
                                      << shape_text(actual) << ", the deck needs "
                                      << shape_text(shape));
  H5Handle d(H5Dopen2(id(), dataset.c_str(), H5P_DEFAULT), H5Dclose);
  H5Handle type(H5Dget_type(d.get()), H5Tclose);
  KMOE_REQUIRE(H5Tget_class(type.get()) == H5T_FLOAT && H5Tget_size(type.get()) == 4,
               path_ << ": dataset " << dataset << " is not float32");
  std::int64_t row_elems = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) row_elems *= shape[i];
  require_host_memory(data, static_cast<std::size_t>(rows * row_elems) * sizeof(float),
                      path_ + ": reading dataset " + dataset, kHdf5NeedsHost);
  const std::int64_t block =
      std::max<std::int64_t>(1, kMaxTransferBytes / std::max<std::int64_t>(1, row_elems * 4));
  const auto dims = dims_of(shape);
  for (std::int64_t r0 = 0; r0 < rows; r0 += block) {
    const std::int64_t nr = std::min(block, rows - r0);
    std::vector<hsize_t> start(dims.size(), 0), count = dims;
    if (!dims.empty()) {
      start[0] = row_begin + r0;
      count[0] = nr;
    }
    H5Handle fspace(H5Dget_space(d.get()), H5Sclose);
    if (!dims.empty())
      H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(),
                          nullptr);
    H5Handle mspace(H5Screate_simple(count.size(), count.data(), nullptr), H5Sclose);
    KMOE_REQUIRE(H5Dread(d.get(), H5T_NATIVE_FLOAT, mspace.get(), fspace.get(), H5P_DEFAULT,
                         data + r0 * row_elems) >= 0,
                 path_ << ": reading dataset " << dataset << " failed (truncated file?)");
    if (progress_) progress_();
  }
}

H5Handle H5File::open_or_create_group(const std::string& object) {
  if (object == "/" || exists(object))
    return H5Handle(H5Oopen(id(), object.c_str(), H5P_DEFAULT), H5Oclose);
  H5Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  H5Handle g(H5Gcreate2(id(), object.c_str(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  KMOE_REQUIRE(g.get() >= 0, path_ << ": cannot create group " << object);
  return g;
}

namespace {
void write_attr(hid_t obj, const std::string& file, const std::string& name, hid_t type,
                hid_t space, const void* value) {
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  H5Handle a(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KMOE_REQUIRE(a.get() >= 0 && H5Awrite(a.get(), type, value) >= 0,
               file << ": cannot write attribute " << name);
}
}  // namespace

void H5File::set_attr(const std::string& object, const std::string& name,
                      const std::string& value) {
  H5Handle obj = open_or_create_group(object);
  H5Handle type = string_type();
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  const char* p = value.c_str();
  write_attr(obj.get(), path_, name, type.get(), space.get(), &p);
}

void H5File::set_attr(const std::string& object, const std::string& name, std::int64_t value) {
  H5Handle obj = open_or_create_group(object);
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  write_attr(obj.get(), path_, name, H5T_NATIVE_INT64, space.get(), &value);
}

void H5File::set_attr(const std::string& object, const std::string& name, double value) {
  H5Handle obj = open_or_create_group(object);
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  write_attr(obj.get(), path_, name, H5T_NATIVE_DOUBLE, space.get(), &value);
}

void H5File::set_attr(const std::string& object, const std::string& name,
                      const std::vector<std::int64_t>& values) {
  H5Handle obj = open_or_create_group(object);
  const hsize_t n = values.size();
  H5Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  write_attr(obj.get(), path_, name, H5T_NATIVE_INT64, space.get(), values.data());
}

bool H5File::has_attr(const std::string& object, const std::string& name) const {
  if (!exists(object)) return false;
  return H5Aexists_by_name(id(), object.c_str(), name.c_str(), H5P_DEFAULT) > 0;
}

namespace {
H5Handle open_attr(const H5File& f, const std::string& object, const std::string& name) {
  KMOE_REQUIRE(f.has_attr(object, name),
               f.path() << ": attribute " << name << " of " << object << " is missing");
  return H5Handle(H5Aopen_by_name(f.id(), object.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT),
                  H5Aclose);
}
}  // namespace

std::string H5File::attr_string(const std::string& object, const std::string& name) const {
  H5Handle a = open_attr(*this, object, name);
  H5Handle ftype(H5Aget_type(a.get()), H5Tclose);
  KMOE_REQUIRE(H5Tget_class(ftype.get()) == H5T_STRING,
               path_ << ": attribute " << name << " of " << object << " is not a string");
  if (H5Tis_variable_str(ftype.get()) > 0) {
    H5Handle type = string_type();
    char* p = nullptr;
    KMOE_REQUIRE(H5Aread(a.get(), type.get(), &p) >= 0 && p,
                 path_ << ": cannot read attribute " << name);
    std::string s(p);
    H5free_memory(p);
    return s;
  }
  std::string s(H5Tget_size(ftype.get()), '\0');
  KMOE_REQUIRE(H5Aread(a.get(), ftype.get(), s.data()) >= 0,
               path_ << ": cannot read attribute " << name);
  return s.substr(0, s.find('\0'));
}

std::int64_t H5File::attr_int(const std::string& object, const std::string& name) const {
  H5Handle a = open_attr(*this, object, name);
  std::int64_t v = 0;
  KMOE_REQUIRE(H5Aread(a.get(), H5T_NATIVE_INT64, &v) >= 0,
               path_ << ": attribute " << name << " of " << object << " is not an integer");
  return v;
}

double H5File::attr_double(const std::string& object, const std::string& name) const {
  H5Handle a = open_attr(*this, object, name);
  double v = 0;
  KMOE_REQUIRE(H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) >= 0,
               path_ << ": attribute " << name << " of " << object << " is not a number");
  return v;
}

}  // namespace kmoe
