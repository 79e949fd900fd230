// The declarative key table behind the input deck. Each key is declared once, with its type,
// default and help, by the code that reads its section (a DeckSection: modules/moe/moe_keys.cpp
// declares [moe], train/train_keys.cpp [train], ...), into Boost's options_description, and
// bound to the Config member it fills, so parsing, --help and the resolved deck cannot drift
// apart; the section's owner checks its combinations too. The program's list of sections is
// assembled at the top (train/deck_sections.cpp).
#pragma once

#include <boost/program_options.hpp>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <type_traits>
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

// `locate(key)`: where the deck sets `key` (its file and line, or the command line), the prefix
// of an error about it.
using Locate = std::function<std::string(const std::string& key)>;

class Schema;

// One section of the deck, declared by the code that reads it.
struct DeckSection {
  const char* name;
  const char* help;
  // Its keys, in --help order, bound to their members of `cfg` (Schema::key, required, derived).
  void (*declare)(Schema& schema, Config& cfg);
  // The combinations one key at a time cannot express; throws kmoe::Error prefixed by
  // locate(key) for the key the user most likely has to change.
  void (*check)(const Config& cfg, const Locate& locate);
  // Checks run in this order (model first: the others are checked against its sizes).
  int check_order;
};

// Every section of the program's deck, in deck order. Defined by the layer that assembles the
// program (train/deck_sections.cpp), the one that sees every section's owner.
const std::vector<DeckSection>& deck_sections();

class Schema {
 public:
  // Binds every key of deck_sections() to a member of `cfg`, which must outlive the schema.
  explicit Schema(Config& cfg);
  Schema(const Schema&) = delete;
  Schema& operator=(const Schema&) = delete;

  const po::options_description& options() const { return options_; }
  const std::vector<SectionSpec>& sections() const { return sections_; }
  const std::vector<KeySpec>& keys() const { return keys_; }
  const KeySpec* find(const std::string& name) const;  // name: section.key
  bool has_section(const std::string& section) const;

  // A section's declarations (DeckSection::declare), into the section being declared: a key
  // with a default, a required key, and a key whose default is another key's final value
  // (`from` names it in --help).
  template <class T, class D>
  void key(T& member, const char* key, const D& def, const char* help);
  template <class T>
  void required(T& member, const char* key, const char* help);
  template <class T>
  void derived(T& member, const char* key, const char* from, std::function<T()> value,
               const char* help);
  // A positive count or `auto` (automatic = true, member = 0 until the program resolves it).
  void count_or_auto(int& member, bool& automatic, const char* key, int def, const char* help);

 private:
  void section(const char* name, const char* help);
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

// Throws kmoe::Error for the first inconsistent combination (every section's check, in
// check_order), prefixed by locate(key) for the key the user most likely has to change.
void check_consistency(const Config& cfg, const Locate& locate);

// The shortest text that reads back to exactly `v`, so a resolved deck reproduces its run.
std::string format_double(double v);

// ---- For the sections' checks ---------------------------------------------------------------

// `key` is the key the user most likely has to change; the message still names the others.
#define KMOE_DECK_REQUIRE(cond, key, msg) KMOE_REQUIRE(cond, locate(key) << ": " << msg)

// `value` must be one of `allowed`.
void require_one_of(const Locate& locate, const char* key, const std::string& value,
                    std::initializer_list<const char*> allowed);
// A block list names each block once: `1, 1` would silently build a different model.
void check_distinct(const std::vector<int>& blocks, const char* key, const Locate& locate);

// ---- The declarations' machinery ------------------------------------------------------------

namespace detail {

inline std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\r\n") + 1 - begin);
}

// Boost's bool and number readers take "" as true or fail obscurely; say what is wrong instead.
inline void require_nonempty(const std::string& text) {
  KMOE_REQUIRE(!text.empty(), "empty value");
}

// Whole text an int (no sign other than '-', no spaces, no trailing characters).
inline bool parse_int(const std::string& text, int* x) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *x);
  return !text.empty() && ec == std::errc() && end == text.data() + text.size();
}

// An empty string is the empty list, so an optional list can be written out and read back.
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  if (trim(text).empty()) return items;
  std::string::size_type start = 0;
  while (true) {
    const auto comma = text.find(',', start);
    items.push_back(trim(text.substr(start, comma - start)));
    KMOE_REQUIRE(!items.back().empty(), "empty entry in list '" << text << "'");
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

template <class T>
std::string join_list(const std::vector<T>& items) {
  std::string out;
  for (const T& item : items) {
    if (!out.empty()) out += ", ";
    if constexpr (std::is_same_v<T, std::string>) {
      out += item;
    } else {
      out += std::to_string(item);
    }
  }
  return out;
}

// How each member type travels through Boost: the type Boost stores and converts (lists go as
// their text), the check on the raw text, and the conversions to and from deck text.

// How each member type travels through Boost: the type Boost stores and converts (lists go as
// their text), the check on the raw text, and the conversions to and from deck text.
template <class T, class = void>
struct Traits;

// A choice (an enum of core/config.hpp): stored as its spelling; anything else is a
// ChoiceError that the parser reports with the key and the allowed spellings.
template <class E>
struct Traits<E, std::enable_if_t<std::is_enum_v<E>>> {
  using Stored = std::string;
  static constexpr const char* type = "choice";
  static void check(const std::string& text) {
    E value;
    if (!parse_choice(text, &value)) throw ChoiceError(choice_list<E>());
  }
  static E from(const std::string& text) {
    E value{};
    if (!parse_choice(text, &value)) throw ChoiceError(choice_list<E>());
    return value;
  }
  static std::string to_stored(E v) { return choice_name(v); }
  static std::string text(E v) { return choice_name(v); }
};

template <>
struct Traits<int> {
  using Stored = int;
  static constexpr const char* type = "int";
  static void check(const std::string& text) { require_nonempty(text); }
  static int from(int v) { return v; }
  static int to_stored(int v) { return v; }
  static std::string text(int v) { return std::to_string(v); }
};

template <>
struct Traits<std::uint64_t> {
  using Stored = std::uint64_t;
  static constexpr const char* type = "uint64";
  static void check(const std::string& text) {
    require_nonempty(text);
    KMOE_REQUIRE(text.find('-') == std::string::npos, "expected a non-negative integer");
  }
  static std::uint64_t from(std::uint64_t v) { return v; }
  static std::uint64_t to_stored(std::uint64_t v) { return v; }
  static std::string text(std::uint64_t v) { return std::to_string(v); }
};

template <>
struct Traits<double> {
  using Stored = double;
  static constexpr const char* type = "double";
  static void check(const std::string& text) { require_nonempty(text); }
  static double from(double v) {
    KMOE_REQUIRE(std::isfinite(v), "expected a finite number");
    return v;
  }
  static double to_stored(double v) { return v; }
  static std::string text(double v) { return format_double(v); }
};

template <>
struct Traits<bool> {
  using Stored = bool;
  static constexpr const char* type = "bool";
  static void check(const std::string& text) { require_nonempty(text); }
  static bool from(bool v) { return v; }
  static bool to_stored(bool v) { return v; }
  static std::string text(bool v) { return v ? "true" : "false"; }
};

template <>
struct Traits<std::string> {
  using Stored = std::string;
  static constexpr const char* type = "string";
  static void check(const std::string&) {}
  static std::string from(const std::string& v) { return v; }
  static std::string to_stored(const std::string& v) { return v; }
  static std::string text(const std::string& v) { return v; }
};

template <>
struct Traits<std::vector<std::string>> {
  using Stored = std::string;
  static constexpr const char* type = "list of strings";
  static void check(const std::string&) {}
  static std::vector<std::string> from(const std::string& v) { return split_list(v); }
  static std::string to_stored(const std::vector<std::string>& v) { return join_list(v); }
  static std::string text(const std::vector<std::string>& v) { return join_list(v); }
};

template <>
struct Traits<std::vector<int>> {
  using Stored = std::string;
  static constexpr const char* type = "list of ints";
  static void check(const std::string&) {}
  static std::vector<int> from(const std::string& v) {
    std::vector<int> out;
    for (const std::string& item : split_list(v)) {
      int x = 0;
      KMOE_REQUIRE(parse_int(item, &x), "list entry '" << item << "' is not an int");
      out.push_back(x);
    }
    return out;
  }
  static std::string to_stored(const std::vector<int>& v) { return join_list(v); }
  static std::string text(const std::vector<int>& v) { return join_list(v); }
};

}  // namespace detail

template <class T>
KeySpec& Schema::declare(T& member, const char* key, const T* def, bool required,
                         const char* help) {
  using Tr = detail::Traits<T>;
  using Stored = typename Tr::Stored;
  KeySpec spec;
  spec.section = sections_.back().name;
  spec.key = key;
  spec.type = Tr::type;
  spec.required = required;
  spec.help = help;
  auto* semantic = po::value<Stored>();
  if (def) {
    spec.default_text = Tr::text(*def);
    semantic->default_value(Tr::to_stored(*def), spec.default_text);
  } else if (required) {
    semantic->required();
  }
  spec.check_text = &Tr::check;
  spec.assign = [&member](const po::variable_value& v) { member = Tr::from(v.as<Stored>()); };
  spec.show = [&member] { return Tr::text(member); };
  options_.add_options()(spec.name().c_str(), semantic, help);
  keys_.push_back(std::move(spec));
  return keys_.back();
}

template <class T, class D>
void Schema::key(T& member, const char* key, const D& def, const char* help) {
  const T value(def);
  declare(member, key, &value, false, help);
}

template <class T>
void Schema::required(T& member, const char* key, const char* help) {
  declare<T>(member, key, nullptr, true, help);
}

template <class T>
void Schema::derived(T& member, const char* key, const char* from, std::function<T()> value,
                     const char* help) {
  KeySpec& spec = declare<T>(member, key, nullptr, false, help);
  spec.default_text = from;
  spec.derive_default = [&member, value] { member = value(); };
}

}  // namespace kmoe::deck
