<schema name="trip-planner">
  <system>You are a travel agent. Answer in one short paragraph.</system>
  <user>
    <module name="trip-plan">Plan a trip of <param name="duration" len="4"/> days.</module>
    <union default="miami">
      <module name="miami">The destination is Miami: beaches, Art Deco buildings and Cuban food.</module>
      <module name="paris">The destination is Paris: museums, cafés and walks along the Seine.</module>
    </union>
  </user>
</schema>
