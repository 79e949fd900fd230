// The program's deck: every section, in deck order, from the code that reads it (a module, io,
// the training loop). Adding a key touches its owner's *_keys.cpp and its Config member.
#include "io/deck_schema.hpp"
#include "io/io_keys.hpp"
#include "modules/engram/engram_keys.hpp"
#include "modules/model/model_keys.hpp"
#include "modules/moe/moe_keys.hpp"
#include "train/train_keys.hpp"

namespace kmoe::deck {

const std::vector<DeckSection>& deck_sections() {
  static const std::vector<DeckSection> sections = {
      model_deck_section(),    moe_deck_section(),        engram_deck_section(),
      train_deck_section(),    optimizer_deck_section(),  data_deck_section(),
      parallel_deck_section(), checkpoint_deck_section(), output_deck_section()};
  return sections;
}

}  // namespace kmoe::deck
