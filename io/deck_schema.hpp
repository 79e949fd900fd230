// Internal to io/: the declarative key table behind the input deck. Each key is declared once,
// with its type, default and help, into Boost's options_description and bound to the Config
// member it fills, so parsing, --help and the resolved deck cannot drift apart.
#pragma once

#include <boost/program_options.hpp>
#include <functional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"

namespace kmoe::deck {

namespace po = boost::program_options;

struct KeySpec {
  std::string section;
  std::string key;
  std::string type;          // as --help shows it: int, double, bool, uint64, string, list of ...
  std::string default_text;  // deck text of the default, or the key it is derived from
  bool required = false;
  std::string help;
  // Rejects text Boost would accept but misread (an empty bool reads as true, "-1" as 2^64-1).
  std::function<void(const std::string&)> check_text;
  // Copies Boost's stored value into the bound Config member; throws kmoe::Error on bad lists.
  std::function<void(const po::variable_value&)> assign;
  // For keys whose default is another key's final value: sets it when the deck leaves it out.
  std::function<void()> derive_default;
  // The bound member's value as deck text that parses back to the same value.
  std::function<std::string()> show;

  std::string name() const { return section + "." + key; }
};

struct SectionSpec {
  std::string name;
  std::string help;
};

class Schema {
 public:
  // Binds every key to a member of `cfg`, which must outlive the schema.
  explicit Schema(Config& cfg);
  Schema(const Schema&) = delete;
  Schema& operator=(const Schema&) = delete;

  const po::options_description& options() const { return options_; }
  const std::vector<SectionSpec>& sections() const { return sections_; }
  const std::vector<KeySpec>& keys() const { return keys_; }
  const KeySpec* find(const std::string& name) const;  // name: section.key
  bool has_section(const std::string& section) const;

 private:
  void section(const char* name, const char* help);
  template <class T, class D>
  void key(T& member, const char* key, const D& def, const char* help);
  template <class T>
  void required(T& member, const char* key, const char* help);
  template <class T>
  void derived(T& member, const char* key, const char* from, std::function<T()> value,
               const char* help);
  template <class T>
  KeySpec& declare(T& member, const char* key, const T* def, bool required, const char* help);

  po::options_description options_;
  std::vector<SectionSpec> sections_;
  std::vector<KeySpec> keys_;
};

// A value that spells none of a choice key's options; what() lists them ("a | b").
class ChoiceError : public Error {
 public:
  using Error::Error;
};

// Throws kmoe::Error for the first inconsistent combination, prefixed by locate(key) for the key
// the user most likely has to change (its file and line, or the command line).
void check_consistency(const Config& cfg,
                       const std::function<std::string(const std::string& key)>& locate);

// The shortest text that reads back to exactly `v`, so a resolved deck reproduces its run.
std::string format_double(double v);

}  // namespace kmoe::deck
