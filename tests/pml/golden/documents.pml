<schema name="documents">
  <system>Answer using only the documents.</system>
  <user>
    <module name="doc1">Cats sleep a lot.</module>
    <module name="doc2">Tea is brewed hot.</module>
    <module name="doc3">Rome is old.</module>
  </user>
  <scaffold modules="doc1 doc2"/>
</schema>
