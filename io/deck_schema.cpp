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
