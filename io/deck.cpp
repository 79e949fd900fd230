// Boost 1.74's config-file parser reports no line numbers, and its errors name neither file nor
// line, so the deck is also scanned here (same line rules) to map each key to its line. Boost
// still reads the file and converts every value through the schema's options (io/deck_schema.hpp:
// every section as its owner declares it).
#include "io/deck.hpp"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.hpp"
#include "io/deck_schema.hpp"

namespace kmoe {
namespace {

namespace po = boost::program_options;

// One `key = value` as the deck or the command line gave it.
struct Setting {
  std::string name;  // section.key
  std::string value;
  int line = 0;  // 0: from the command line
};

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\r\n") + 1 - begin);
}

// Boost's line rules (comment from '#', whitespace trimmed, `[section]` prefixes the keys after
// it), but what Boost would take silently or misread is an error here: a key before any
// section, a malformed header, a repeated key (Boost would keep the first).
std::vector<Setting> scan_deck(const std::string& text, const std::string& origin) {
  std::vector<Setting> settings;
  std::map<std::string, int> first_line;
  std::istringstream in(text);
  std::string raw;
  std::string section;
  for (int line = 1; std::getline(in, raw); ++line) {
    const std::string s = trim(raw.substr(0, raw.find('#')));
    if (s.empty()) continue;
    const std::string at = origin + ":" + std::to_string(line) + ": ";
    if (s.front() == '[') {
      KMOE_REQUIRE(s.size() > 2 && s.find_first_of(" \t.[]", 1) == s.size() - 1 && s.back() == ']',
                   at << "malformed section header '" << s << "' (expected [name])");
      section = s.substr(1, s.size() - 2);
      continue;
    }
    const auto eq = s.find('=');
    KMOE_REQUIRE(eq != std::string::npos,
                 at << "expected 'key = value' or '[section]', got '" << s << "'");
    const std::string key = trim(s.substr(0, eq));
    const std::string value = trim(s.substr(eq + 1));
    KMOE_REQUIRE(!key.empty(), at << "missing key before '=' in '" << s << "'");
    KMOE_REQUIRE(!section.empty(),
                 at << key << " = " << value << ": key outside any [section]; put it under one");
    const std::string name = section + "." + key;
    const auto [first, fresh] = first_line.emplace(name, line);
    KMOE_REQUIRE(fresh, at << "[" << section << "] " << key << " = " << value << ": duplicate key "
                           << name << " (first set on line " << first->second << ")");
    settings.push_back({name, value, line});
  }
  return settings;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : sep) + item;
  return out;
}

class DeckParser {
 public:
  DeckParser(const std::string& origin, DeckSource source)
      : origin_(origin), source_(std::move(source)), schema_(cfg_) {}

  Config parse(const std::string& text, const std::vector<std::string>& overrides);

 private:
  void read_text(const std::string& text);
  void read_overrides(const std::vector<std::string>& overrides);
  void require_known(const Setting& s) const;
  po::variables_map convert() const;
  void assign(const po::variables_map& vm);
  const Setting* given(const std::string& name) const;
  std::string locate(const Setting& s) const;
  std::string locate(const std::string& name) const;
  std::string resolved_text() const;

  std::string origin_;
  DeckSource source_;
  Config cfg_;
  deck::Schema schema_;            // bound to cfg_
  std::vector<Setting> settings_;  // deck order, then keys only the command line sets
};

Config DeckParser::parse(const std::string& text, const std::vector<std::string>& overrides) {
  read_text(text);
  read_overrides(overrides);
  assign(convert());
  deck::check_consistency(cfg_, [this](const std::string& name) { return locate(name); });
  cfg_.model.document_eod =
      cfg_.train.document_mask ? cfg_.data.end_of_document(cfg_.model.vocab_size) : -1;
  cfg_.resolved_text = resolved_text();
  return cfg_;
}

void DeckParser::read_text(const std::string& text) {
  settings_ = scan_deck(text, origin_);
  std::istringstream in(text);
  po::parsed_options parsed(&schema_.options());
  try {
    // Unregistered keys pass so that require_known can report them with their line.
    parsed = po::parse_config_file(in, schema_.options(), /*allow_unregistered=*/true);
  } catch (const po::error& e) {
    KMOE_FAIL(origin_ << ": " << e.what());
  }
  // Boost's reading is authoritative; the scan only adds line numbers, so they must agree.
  KMOE_REQUIRE(parsed.options.size() == settings_.size(),
               origin_ << ": internal error: Boost read " << parsed.options.size()
                       << " settings, the line scan " << settings_.size());
  for (std::size_t i = 0; i < settings_.size(); ++i) {
    const po::option& opt = parsed.options[i];
    KMOE_REQUIRE(opt.string_key == settings_[i].name && opt.value.size() == 1 &&
                     opt.value[0] == settings_[i].value,
                 locate(settings_[i]) << ": internal error: Boost read it as " << opt.string_key);
    require_known(settings_[i]);
  }
}

void DeckParser::read_overrides(const std::vector<std::string>& overrides) {
  for (const std::string& arg : overrides) {
    const std::string s = arg.rfind("--", 0) == 0 ? arg.substr(2) : arg;
    const auto eq = s.find('=');
    const std::string name = trim(s.substr(0, eq));
    KMOE_REQUIRE(eq != std::string::npos && !name.empty(),
                 "command line: " << arg << ": expected --section.key=value");
    Setting setting{name, trim(s.substr(eq + 1)), 0};
    require_known(setting);
    bool replaced = false;
    for (Setting& earlier : settings_) {
      if (earlier.name == name) {
        earlier = setting;
        replaced = true;
      }
    }
    if (!replaced) settings_.push_back(setting);
  }
}

void DeckParser::require_known(const Setting& s) const {
  if (schema_.find(s.name)) return;
  const std::string section = s.name.substr(0, s.name.find('.'));
  std::vector<std::string> names;
  if (!schema_.has_section(section)) {
    for (const deck::SectionSpec& sec : schema_.sections()) names.push_back(sec.name);
    KMOE_FAIL(locate(s) << ": unknown key " << s.name << ": there is no section [" << section
                        << "] (sections: " << join(names, ", ") << ")");
  }
  for (const deck::KeySpec& spec : schema_.keys()) {
    if (spec.section == section) names.push_back(spec.key);
  }
  KMOE_FAIL(locate(s) << ": unknown key " << s.name << " (keys of [" << section
                      << "]: " << join(names, ", ") << ")");
}

// Stores one setting at a time so that a conversion error is pinned to its key and line.
po::variables_map DeckParser::convert() const {
  po::variables_map vm;
  for (const Setting& s : settings_) {
    const deck::KeySpec& spec = *schema_.find(s.name);
    try {
      spec.check_text(s.value);
      po::parsed_options one(&schema_.options());
      one.options.emplace_back(s.name, std::vector<std::string>{s.value});
      po::store(one, vm);
    } catch (const deck::ChoiceError& e) {
      KMOE_FAIL(locate(s) << ": " << s.name << " must be one of " << e.what() << ", got '"
                          << s.value << "'");
    } catch (const po::error&) {
      KMOE_FAIL(locate(s) << ": invalid value '" << s.value << "' for " << s.name << " (expected "
                          << spec.type
                          << (spec.type == "bool" ? ": true/false, yes/no, on/off or 1/0" : "")
                          << ")");
    } catch (const Error& e) {
      KMOE_FAIL(locate(s) << ": invalid value '" << s.value << "' for " << s.name << ": "
                          << e.what());
    }
  }
  // Fills in the defaults of every key not given.
  po::store(po::parsed_options(&schema_.options()), vm);
  return vm;
}

void DeckParser::assign(const po::variables_map& vm) {
  std::string missing;
  for (const deck::KeySpec& spec : schema_.keys()) {
    if (!spec.required || vm.count(spec.name())) continue;
    missing += (missing.empty() ? "" : "\n") + origin_ + ": missing required key " + spec.name() +
               " ([" + spec.section + "] " + spec.key + "): " + spec.help;
  }
  KMOE_REQUIRE(missing.empty(), missing);
  for (const deck::KeySpec& spec : schema_.keys()) {
    if (!vm.count(spec.name())) continue;
    try {
      spec.assign(vm[spec.name()]);
    } catch (const Error& e) {
      KMOE_FAIL(locate(spec.name()) << ": " << spec.name() << ": " << e.what());
    }
  }
  // After every given key is in place: a derived default reads another key's final value.
  for (const deck::KeySpec& spec : schema_.keys()) {
    if (spec.derive_default && !vm.count(spec.name())) spec.derive_default();
  }
}

const Setting* DeckParser::given(const std::string& name) const {
  for (const Setting& s : settings_) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::string DeckParser::locate(const Setting& s) const {
  if (s.line == 0) return "command line: --" + s.name + "=" + s.value;
  if (source_) {
    const std::string from = source_(s.name, s.value);
    if (!from.empty()) return from;
  }
  const auto dot = s.name.find('.');
  return origin_ + ":" + std::to_string(s.line) + ": [" + s.name.substr(0, dot) + "] " +
         s.name.substr(dot + 1) + " =" + (s.value.empty() ? "" : " ") + s.value;
}

// A key left at its default is located in the deck as a whole.
std::string DeckParser::locate(const std::string& name) const {
  if (const Setting* s = given(name)) return locate(*s);
  const deck::KeySpec& spec = *schema_.find(name);
  return origin_ + ": [" + spec.section + "] " + spec.key + " = " + spec.show() + " (default)";
}

std::string DeckParser::resolved_text() const {
  std::ostringstream os;
  os << "# kmoe resolved deck\n";
  for (const deck::SectionSpec& section : schema_.sections()) {
    os << "\n[" << section.name << "]\n";
    for (const deck::KeySpec& spec : schema_.keys()) {
      if (spec.section != section.name) continue;
      const std::string value = spec.show();
      os << spec.key << " =" << (value.empty() ? "" : " ") << value << "\n";
    }
  }
  return os.str();
}

}  // namespace

Config read_deck(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  KMOE_REQUIRE(in, "cannot open input deck " << path);
  std::ostringstream text;
  text << in.rdbuf();
  KMOE_REQUIRE(!in.bad(), "error reading input deck " << path);
  Config cfg = parse_deck(text.str(), path, overrides);
  cfg.deck_path = path;
  return cfg;
}

Config parse_deck(const std::string& text, const std::string& origin,
                  const std::vector<std::string>& overrides, const DeckSource& source) {
  return DeckParser(origin, source).parse(text, overrides);
}

std::vector<std::pair<std::string, std::string>> resolved_values(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(text);
  std::string line, section;
  auto trim = [](std::string s) {
    const auto b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = trim(line.substr(1, line.size() - 2));
    } else if (const auto eq = line.find('='); eq != std::string::npos) {
      out.emplace_back(section + "." + trim(line.substr(0, eq)), trim(line.substr(eq + 1)));
    }
  }
  return out;
}

std::string deck_help() {
  Config scratch;
  const deck::Schema schema(scratch);
  std::size_t key_w = 0, type_w = 0, default_w = 0;
  auto default_of = [](const deck::KeySpec& spec) {
    if (spec.required) return std::string("required");
    if (spec.derive_default) return "= " + spec.default_text;
    return spec.default_text.empty() ? std::string("(empty)") : spec.default_text;
  };
  for (const deck::KeySpec& spec : schema.keys()) {
    key_w = std::max(key_w, spec.key.size());
    type_w = std::max(type_w, spec.type.size());
    default_w = std::max(default_w, default_of(spec).size());
  }
  std::ostringstream os;
  os << "Input deck: INI text, [section] then key = value, # comments, lists comma-separated.\n"
     << "Any key can be overridden on the command line as --section.key=value.\n"
     << "Columns: key, type, default (or required), description.\n";
  for (const deck::SectionSpec& section : schema.sections()) {
    os << "\n[" << section.name << "]  " << section.help << "\n";
    for (const deck::KeySpec& spec : schema.keys()) {
      if (spec.section != section.name) continue;
      const std::string def = default_of(spec);
      os << "  " << spec.key << std::string(key_w - spec.key.size() + 2, ' ') << spec.type
         << std::string(type_w - spec.type.size() + 2, ' ') << def
         << std::string(default_w - def.size() + 2, ' ') << spec.help << "\n";
    }
  }
  return os.str();
}

}  // namespace kmoe
