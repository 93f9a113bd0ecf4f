<schema name="nested">Root text.
  <module name="outer">Outer head.
    <module name="inner">Inner.</module>
    <union>
      <module name="a">A.</module>
      <module name="b">Bee bee bee.</module>
    </union>
    Outer tail.
  </module>
  <module name="live" cache="false">Live <param name="value" len="3"/> data.</module>
  Closing.
</schema>
