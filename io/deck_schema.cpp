// The key table's assembly (RUNTIME.md section 5): every section of deck_sections(), declared by
// its owner, in deck order.
#include "io/deck_schema.hpp"

#include <cstdio>
#include <cstdlib>

namespace kmoe::deck {

std::string format_double(double v) {
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // "500000" reads better than "5e+05" in a deck.
  if (std::string(buf).find('e') != std::string::npos && v == std::floor(v) && std::fabs(v) < 1e9) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  }
  return buf;
}

void Schema::section(const char* name, const char* help) { sections_.push_back({name, help}); }

Schema::Schema(Config& c) : options_("kmoe input deck") {
  for (const DeckSection& s : deck_sections()) {
    section(s.name, s.help);
    s.declare(*this, c);
  }
}

void Schema::count_or_auto(int& member, bool& automatic, const char* key, int def,
                           const char* help) {
  auto number = [](const std::string& text) {
    int x = 0;
    KMOE_REQUIRE(detail::parse_int(detail::trim(text), &x), "expected an int or auto");
    return x;
  };
  KeySpec spec;
  spec.section = sections_.back().name;
  spec.key = key;
  spec.type = "int|auto";
  spec.help = help;
  spec.default_text = std::to_string(def);
  auto* semantic = po::value<std::string>();
  semantic->default_value(spec.default_text, spec.default_text);
  spec.check_text = [number](const std::string& text) {
    if (detail::trim(text) != "auto") number(text);
  };
  spec.assign = [&member, &automatic, number](const po::variable_value& v) {
    const std::string& text = v.as<std::string>();
    automatic = detail::trim(text) == "auto";
    member = automatic ? 0 : number(text);
  };
  spec.show = [&member, &automatic] {
    return automatic && member == 0 ? std::string("auto") : std::to_string(member);
  };
  options_.add_options()(spec.name().c_str(), semantic, help);
  keys_.push_back(std::move(spec));
}

const KeySpec* Schema::find(const std::string& name) const {
  for (const KeySpec& spec : keys_) {
    if (spec.name() == name) return &spec;
  }
  return nullptr;
}

bool Schema::has_section(const std::string& section) const {
  for (const SectionSpec& s : sections_) {
    if (s.name == section) return true;
  }
  return false;
}

}  // namespace kmoe::deck
