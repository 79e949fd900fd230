// The deck's combination checks, run when the deck is read, before any rank allocates, so a bad
// deck fails in a second with the line to fix: every section's own check (DeckSection::check),
// in check order.
#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "io/deck_schema.hpp"

namespace kmoe::deck {

void require_one_of(const Locate& locate, const char* key, const std::string& value,
                    std::initializer_list<const char*> allowed) {
  std::string choices;
  for (const char* option : allowed) {
    if (value == option) return;
    choices += (choices.empty() ? "" : " | ") + std::string(option);
  }
  KMOE_FAIL(locate(key) << ": " << key << " must be one of " << choices << ", got '" << value
                        << "'");
}

void check_distinct(const std::vector<int>& blocks, const char* key, const Locate& locate) {
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      KMOE_DECK_REQUIRE(blocks[i] != blocks[j], key,
                        key << " lists block " << blocks[i] << " twice");
}

void check_consistency(const Config& cfg, const Locate& locate) {
  std::vector<const DeckSection*> order;
  for (const DeckSection& s : deck_sections()) order.push_back(&s);
  std::stable_sort(order.begin(), order.end(), [](const DeckSection* a, const DeckSection* b) {
    return a->check_order < b->check_order;
  });
  for (const DeckSection* s : order)
    if (s->check) s->check(cfg, locate);
}

}  // namespace kmoe::deck
