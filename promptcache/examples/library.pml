<schema name="library">
  <system>You are a helpful assistant. Answer briefly, using only the documents.</system>
  <user>
    <module name="doc-amazon">The Amazon river flows east across South America and empties into the Atlantic
      Ocean. It carries more water than any other river on Earth.</module>
    <module name="doc-everest">Mount Everest, on the border of Nepal and China, is the highest mountain above
      sea level, at 8,849 metres.</module>
    <module name="doc-honey">Bees make honey from flower nectar. Honey stored in a sealed jar can stay edible
      for thousands of years.</module>
  </user>
  <scaffold modules="doc-amazon doc-everest"/>
</schema>
