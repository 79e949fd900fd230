// The deck sections the training loop reads: [train], [optimizer] and [parallel] (the grid the
// trainer builds; src/parallel sits below the deck's schema, so its section is declared here).
#pragma once

#include "io/deck_schema.hpp"

namespace kmoe {

deck::DeckSection train_deck_section();      // [train]
deck::DeckSection optimizer_deck_section();  // [optimizer]
deck::DeckSection parallel_deck_section();   // [parallel]

}  // namespace kmoe
