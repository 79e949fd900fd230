// The deck sections io reads: [data] (token files, tokenizer), [checkpoint] and [output].
#pragma once

#include "io/deck_schema.hpp"

namespace kmoe {

deck::DeckSection data_deck_section();        // [data]
deck::DeckSection checkpoint_deck_section();  // [checkpoint]
deck::DeckSection output_deck_section();      // [output]

}  // namespace kmoe
